#!/bin/bash
cd /app/inventory
sed -i 's/        self._stock\[item\] = quantity$/        self._stock[item] = self._stock.get(item, 0) + quantity/' inventory.py
sed -i 's/        return sorted(self._stock)$/        return sorted(k for k, v in self._stock.items() if v > 0)/' inventory.py
