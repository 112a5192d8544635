"""Runs /app/stats.py on inputs it has not seen and compares with the statistics module."""
import os
import statistics
import subprocess
import sys
import tempfile

cases = [[4, 8, 15, 16, 23, 42], [3, 1, 2], [2.5, 0.5, 10.25, 7.0], [-3, 5], [7]]
for values in cases:
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("\n".join(str(v) for v in values) + "\n")
    proc = subprocess.run([sys.executable, "/app/stats.py", f.name], capture_output=True,
                          text=True, timeout=20)
    os.unlink(f.name)
    want = f"mean={statistics.mean(values):.2f} median={statistics.median(values):.2f}"
    if proc.stdout.strip() != want:
        sys.exit(f"{values}: expected {want!r}, got {proc.stdout.strip()!r} {proc.stderr[-300:]}")
print("ok")
