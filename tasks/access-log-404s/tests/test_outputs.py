"""Checks /app/404s.txt against /app/access.log."""
import collections
import sys

counts = collections.Counter()
for line in open("/app/access.log"):
    fields = line.split()
    if fields[8] == "404":
        counts[fields[0]] += 1
want = [f"{ip} {n}" for ip, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
try:
    got = [line.strip() for line in open("/app/404s.txt") if line.strip()]
except FileNotFoundError:
    sys.exit("404s.txt missing")
if got != want:
    sys.exit(f"expected {want}, got {got}")
print("ok")
