"""Checks /app/summary.txt against counts computed from /app/server.log."""
import collections
import re
import sys

counts = collections.Counter()
for line in open("/app/server.log"):
    match = re.search(r"\[([A-Z]+)\]", line)
    if match:
        counts[match.group(1)] += 1
expected = [f"{lvl} {n}" for lvl, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
try:
    got = open("/app/summary.txt").read().split("\n")
except FileNotFoundError:
    sys.exit("summary.txt missing")
got = [line for line in got if line.strip()]
if got != expected:
    sys.exit(f"expected {expected}, got {got}")
print("ok")
