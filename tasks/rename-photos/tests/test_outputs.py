"""Checks the names and contents in /app/photos."""
import os
import sys

want = {f"photo-{n}.jpg": f"jpeg {n}\n" for n in ("0003", "0017", "0042", "0101", "0999")}
want["photo-0500.jpg"] = "raw 0500\n"
want["notes.txt"] = "holiday notes\n"
got = {name: open(os.path.join("/app/photos", name)).read()
       for name in os.listdir("/app/photos")}
if got != want:
    sys.exit(f"expected {sorted(want)}, got {sorted(got)}")
print("ok")
