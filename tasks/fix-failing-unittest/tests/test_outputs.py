"""Runs the original tests (plus hidden ones) against the agent's inventory.py."""
import shutil
import subprocess
import sys
import tempfile

work = tempfile.mkdtemp()
shutil.copy("/app/inventory/inventory.py", work)
shutil.copy("/tests/test_inventory.py", work)
with open(f"{work}/test_hidden.py", "w") as f:
    f.write('''
import unittest
from inventory import Inventory, OutOfStock

class Hidden(unittest.TestCase):
    def test_unknown_item(self):
        self.assertEqual(Inventory().count("nothing"), 0)
        with self.assertRaises(OutOfStock):
            Inventory().remove("nothing", 1)

    def test_sorted(self):
        inv = Inventory()
        for name in ("c", "a", "b"):
            inv.add(name, 2)
        inv.remove("b", 2)
        self.assertEqual(inv.items(), ["a", "c"])
''')
proc = subprocess.run([sys.executable, "-m", "unittest", "-q"], cwd=work, capture_output=True,
                      text=True, timeout=30)
print(proc.stderr[-2000:])
sys.exit(proc.returncode)
