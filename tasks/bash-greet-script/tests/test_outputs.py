"""Runs /app/greet.sh with several argument lists."""
import os
import subprocess
import sys

script = "/app/greet.sh"
if not os.access(script, os.X_OK):
    sys.exit("greet.sh missing or not executable")
cases = [
    (["Ada"], 0, "Hello, Ada!\n"),
    (["--shout", "Grace"], 0, "HELLO, GRACE!\n"),
    (["Linus", "--shout"], 0, "HELLO, LINUS!\n"),
    (["--count", "3", "Bo"], 0, "Hello, Bo!\n" * 3),
    (["--count", "2", "--shout", "x y"], 0, "HELLO, X Y!\n" * 2),
]
for args, code, out in cases:
    proc = subprocess.run([script, *args], capture_output=True, text=True, timeout=10)
    if (proc.returncode, proc.stdout) != (code, out):
        sys.exit(f"{args}: got ({proc.returncode}, {proc.stdout!r}), want ({code}, {out!r})")
for args in ([], ["--bogus", "Ada"]):
    proc = subprocess.run([script, *args], capture_output=True, text=True, timeout=10)
    if proc.returncode != 2 or not proc.stderr.startswith("usage:"):
        sys.exit(f"{args}: expected usage on stderr and status 2, got {proc.returncode}")
print("ok")
