"""Checks the repository in /app/project."""
import subprocess
import sys

def git(*args):
    proc = subprocess.run(["git", "-C", "/app/project", *args], capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"git {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout.strip()

git("config", "--global", "--add", "safe.directory", "/app/project")
if git("rev-parse", "--abbrev-ref", "HEAD") != "main":
    sys.exit("branch is not main")
if git("rev-list", "--count", "HEAD") != "1":
    sys.exit("expected exactly one commit")
if git("log", "-1", "--format=%s") != "Initial import":
    sys.exit("wrong message")
if git("log", "-1", "--format=%an <%ae>") != "Riptide Bot <bot@example.com>":
    sys.exit("wrong author")
files = sorted(git("ls-tree", "-r", "--name-only", "HEAD").split("\n"))
if files != [".gitignore", "README.md", "src/hello.py"]:
    sys.exit(f"wrong files committed: {files}")
if git("status", "--porcelain"):
    sys.exit("working tree not clean")
print("ok")
