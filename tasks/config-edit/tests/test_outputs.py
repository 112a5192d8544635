"""Checks the edited /app/app.conf line by line."""
import sys

want = """# Application settings
# port: the TCP port to listen on
port = 8080
host = 127.0.0.1

# debug mode prints stack traces
debug = false
workers = 4
log_level = warning
"""
got = open("/app/app.conf").read()
if got.rstrip("\n") != want.rstrip("\n"):
    sys.exit(f"unexpected app.conf:\n{got}")
print("ok")
