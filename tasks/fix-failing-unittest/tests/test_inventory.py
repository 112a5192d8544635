import unittest

from inventory import Inventory, OutOfStock


class InventoryTest(unittest.TestCase):
    def test_add_accumulates(self):
        inv = Inventory()
        inv.add("bolt", 3)
        inv.add("bolt", 4)
        self.assertEqual(inv.count("bolt"), 7)

    def test_remove(self):
        inv = Inventory()
        inv.add("nut", 5)
        inv.remove("nut", 2)
        self.assertEqual(inv.count("nut"), 3)
        with self.assertRaises(OutOfStock):
            inv.remove("nut", 4)

    def test_items_in_stock_only(self):
        inv = Inventory()
        inv.add("washer", 1)
        inv.add("gear", 2)
        inv.remove("washer", 1)
        self.assertEqual(inv.items(), ["gear"])

    def test_rejects_non_positive(self):
        with self.assertRaises(ValueError):
            Inventory().add("x", 0)


if __name__ == "__main__":
    unittest.main()
