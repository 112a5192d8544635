"""One shell per episode over the provider interface: later commands see what earlier ones set.

Every command runs through `provider.exec` (so on every provider, local and Daytona alike),
wrapped so that it starts where the previous one ended: in its working directory, with its
shell variables (exported or not), functions and aliases. The wrapper restores that state
from a file in the sandbox before the command and saves it when the command's shell exits
(an EXIT trap, so `exit N` and failures save too). A command killed at its timeout saves
nothing: the next one starts from the state before it, as after a crash.

Background jobs do not outlive their command: each exec is its own process tree (on the local
provider its own pid namespace), which is torn down when the command returns.
"""

from __future__ import annotations

from services.sandbox.provider import ExecResult, SandboxHandle, SandboxProvider

STATE_DIR = "/tmp/.riptide-shell"

# Variables bash manages itself, readonly ones and the wrapper's own are never restored.
_SKIP = (r"^declare -[a-zA-Z]*r[a-zA-Z]* |^declare -[-a-zA-Z]* (BASH[A-Z_]*|PWD|OLDPWD|SHLVL|_|"
         r"PPID|SHELLOPTS|EUID|UID|GROUPS|FUNCNAME|PIPESTATUS|RANDOM|SRANDOM|SECONDS|LINENO|"
         r"HISTCMD|DIRSTACK|COMP_WORDBREAKS|EPOCHREALTIME|EPOCHSECONDS|__riptide_[a-z_]*)(=|$)")

_PROLOGUE = f"""shopt -s expand_aliases
__riptide_state={STATE_DIR}
if [ -r "$__riptide_state/vars" ]; then . "$__riptide_state/vars" >/dev/null 2>&1; fi
if [ -r "$__riptide_state/cwd" ]; then cd -- "$(cat "$__riptide_state/cwd")" 2>/dev/null; fi
__riptide_save() {{
  __riptide_rc=$?
  mkdir -p "$__riptide_state" && pwd > "$__riptide_state/cwd"
  {{ declare -p | grep -Ev '{_SKIP}'; declare -f; alias -p; }} > "$__riptide_state/vars" 2>/dev/null
  exit $__riptide_rc
}}
trap __riptide_save EXIT
"""


def wrap_command(command: str) -> str:
    """`command` as a script that restores the episode's shell state first and saves it last."""
    return f"{_PROLOGUE}{command}\n"


class ShellSession:
    """The episode's shell: `run` is `provider.exec` with state carried between calls."""

    def __init__(self, provider: SandboxProvider, handle: SandboxHandle,
                 persistent: bool = True) -> None:
        self.provider = provider
        self.handle = handle
        self.persistent = persistent

    async def run(self, command: str, timeout_s: float) -> ExecResult:
        """Run one command of the episode, killed with all it started at `timeout_s`."""
        script = wrap_command(command) if self.persistent else command
        return await self.provider.exec(self.handle, script, timeout_s)
