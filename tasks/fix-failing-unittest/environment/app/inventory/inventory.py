"""A tiny stock ledger."""


class OutOfStock(Exception):
    """Raised when removing more items than are in stock."""


class Inventory:
    def __init__(self):
        self._stock = {}

    def add(self, item, quantity):
        if quantity <= 0:
            raise ValueError("quantity must be positive")
        self._stock[item] = quantity

    def remove(self, item, quantity):
        have = self._stock.get(item, 0)
        if quantity > have:
            raise OutOfStock(item)
        self._stock[item] = have - quantity

    def count(self, item):
        return self._stock.get(item, 0)

    def items(self):
        """Names of the items in stock (count > 0), sorted."""
        return sorted(self._stock)
