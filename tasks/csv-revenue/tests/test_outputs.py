"""Checks /app/revenue.csv."""
import csv
import sys

totals = {}
with open("/app/sales.csv") as f:
    for row in csv.DictReader(f):
        totals[row["product"]] = totals.get(row["product"], 0) + int(row["quantity"]) * float(
            row["unit_price"])
want = ["product,revenue"] + [f"{p},{v:.2f}" for p, v in sorted(totals.items(),
                                                                 key=lambda kv: -kv[1])]
try:
    got = [line.strip() for line in open("/app/revenue.csv") if line.strip()]
except FileNotFoundError:
    sys.exit("revenue.csv missing")
if got != want:
    sys.exit(f"expected {want}, got {got}")
print("ok")
