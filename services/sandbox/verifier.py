"""Scores a finished episode with the task's own tests.

After the agent stops, `tests/` (withheld until now) is uploaded to `/tests` and
`bash /tests/test.sh` runs with the task's verifier timeout. The reward is
`/logs/verifier/reward.json` or else `/logs/verifier/reward.txt` (one float), read back
with `cat`; the script's exit code means nothing (terminal-bench scripts exit 0 on
failure). No reward file, a timeout or a sandbox failure is a `no_verdict` with the reason
and its cause (verifier error, verifier timeout, sandbox lost), never a silent 0.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass

from services._proto.riptide.v1 import common_pb2
from services.sandbox import failures
from services.sandbox.provider import ExecResult, SandboxError, SandboxHandle, SandboxProvider
from services.sandbox.reply_format import truncate_middle
from services.sandbox.task import Task

REWARD_DIR = "/logs/verifier"
_SETUP_TIMEOUT_S = 60.0
# Prints the name of the first reward file that exists, then its content; exit 44: none.
_READ_REWARD = (f"for f in reward.json reward.txt; do if [ -f {REWARD_DIR}/$f ]; then "
                f"echo $f; exec cat {REWARD_DIR}/$f; fi; done; exit 44")


@dataclass(frozen=True)
class Verdict:
    """The verifier's outcome: a reward, or why there is none."""

    status: common_pb2.VerdictStatus
    reward: float = 0.0
    message: str = ""
    verify_s: float = 0.0
    exit_code: int | None = None  # of tests/test.sh, when it ran to its end
    cause: failures.Cause = common_pb2.NO_VERDICT_CAUSE_UNSPECIFIED
    """Why there is no verdict (failures.py); unspecified when scored."""

    @classmethod
    def no_verdict(cls, message: str, cause: failures.Cause, verify_s: float = 0.0,
                   exit_code: int | None = None) -> Verdict:
        return cls(common_pb2.VERDICT_STATUS_NO_VERDICT, 0.0, message, verify_s, exit_code,
                   cause)


def _tail(result: ExecResult) -> str:
    return truncate_middle(result.output.strip(), 600) or "(no output)"


def parse_reward(name: str, text: str) -> float:
    """The reward in reward.txt (a float) or reward.json ({"reward": x} or one number)."""
    if name.endswith(".txt"):
        try:
            value = float(text.strip())
        except ValueError:
            raise ValueError(f"{name} holds {text.strip()[:80]!r}, not a float") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name} is not valid JSON: {exc}") from None
        numbers = {k: v for k, v in data.items() if isinstance(v, int | float)} \
            if isinstance(data, dict) else {}
        if isinstance(data, int | float) and not isinstance(data, bool):
            value = float(data)
        elif "reward" in numbers:
            value = float(numbers["reward"])
        elif len(numbers) == 1:
            value = float(next(iter(numbers.values())))
        else:
            raise ValueError(f"{name} has no 'reward' number: {text.strip()[:120]!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} holds {value}, not a finite reward")
    return value


async def verify(provider: SandboxProvider, handle: SandboxHandle, task: Task,
                 timeout_s: float | None = None) -> Verdict:
    """Upload the tests, run them, read the reward. Never raises for a sandbox failure."""
    started = time.monotonic()
    timeout_s = timeout_s or task.config.verifier.timeout_sec
    try:
        verdict = await _verify(provider, handle, task, timeout_s)
    except SandboxError as exc:
        verdict = Verdict.no_verdict(f"sandbox failure during verification: {exc}",
                                     failures.SANDBOX_LOST)
    return dataclasses.replace(verdict, verify_s=time.monotonic() - started)


async def _verify(provider: SandboxProvider, handle: SandboxHandle, task: Task,
                  timeout_s: float) -> Verdict:
    await provider.upload(handle, task.tests_dir, "/tests")
    # Stale reward files (the agent could have written one) go before the tests run.
    run = await provider.exec(
        handle, f"rm -rf {REWARD_DIR} && mkdir -p {REWARD_DIR} && bash /tests/test.sh",
        timeout_s, env=task.config.verifier.env or None)
    if run.timed_out:
        return Verdict.no_verdict(f"tests/test.sh timed out after {timeout_s:g} s: {_tail(run)}",
                                  failures.VERIFIER_TIMEOUT)
    found = await provider.exec(handle, _READ_REWARD, _SETUP_TIMEOUT_S, cwd="/")
    if found.exit_code == 0:
        name, _, text = found.stdout.partition("\n")
        try:
            reward = parse_reward(name, text)
        except ValueError as exc:
            return Verdict.no_verdict(str(exc), failures.VERIFIER_ERROR,
                                      exit_code=run.exit_code)
        return Verdict(common_pb2.VERDICT_STATUS_SCORED, reward, "", exit_code=run.exit_code)
    if found.exit_code != 44:
        return Verdict.no_verdict(f"cannot read {REWARD_DIR}: {_tail(found)}",
                                  failures.VERIFIER_ERROR)
    return Verdict.no_verdict(f"tests/test.sh wrote no {REWARD_DIR}/reward.json or reward.txt "
                              f"(exit code {run.exit_code}): {_tail(run)}",
                              failures.VERIFIER_ERROR, exit_code=run.exit_code)
