"""Recomputes the manifest of /app/data."""
import hashlib
import os
import sys

want = []
for dirpath, _, files in os.walk("/app/data"):
    for name in files:
        path = os.path.join(dirpath, name)
        digest = hashlib.sha256(open(path, "rb").read()).hexdigest()
        want.append(f"{digest}  {os.path.relpath(path, '/app/data')}")
want.sort(key=lambda line: line.split("  ", 1)[1])
try:
    got = [line.rstrip("\n") for line in open("/app/SHA256SUMS") if line.strip()]
except FileNotFoundError:
    sys.exit("SHA256SUMS missing")
if got != want:
    sys.exit(f"expected {want}, got {got}")
print("ok")
