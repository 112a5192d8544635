"""Runs a test module's check function in Triton's interpreter (TRITON_INTERPRET=1), in a
process of its own: Triton reads the mode when it is first imported, and other tests in the
same process may have imported it already. Kernels there run on CPU tensors."""

from __future__ import annotations

import os
import subprocess
import sys


def run_in_interpreter(module_file: str, function: str, timeout_s: float = 240.0) -> str:
    """Call `function()` of the module at `module_file` under the interpreter; its stdout.
    Raises AssertionError with the process's stderr when it fails."""
    script = ("import importlib.util; spec = importlib.util.spec_from_file_location('check',"
              f" {module_file!r}); module = importlib.util.module_from_spec(spec);"
              f" spec.loader.exec_module(module); module.{function}()")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=timeout_s)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
