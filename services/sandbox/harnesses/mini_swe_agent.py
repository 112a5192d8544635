"""mini-swe-agent, run unchanged: its `DefaultAgent` with its default config (`default.yaml`).

The default config asks the model for one ```` ```mswea_bash_command ```` block per turn and
ends the run when a command prints `COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`; its matching
model class is the text-based litellm model, which reaches the episode's gateway as
`openai/<model>` at the gateway's base URL with the episode's key. Commands run in the
sandbox (mini_swe_environment.py). The agent is synchronous: it runs in a worker thread,
and its commands are sent back to the service's event loop.

Only limits are set on top of the defaults: the step limit is the episode's `max_turns`, the
wall-time limit its deadline, cost tracking ignores models without a price (every model
behind the gateway) and the trajectory is written to the episode's work folder. Needs the
`mini-swe-agent` extra.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from services.sandbox.harness import (
    Harness,
    HarnessContext,
    HarnessError,
    HarnessOutcome,
    HarnessTimeout,
)
from services.sandbox.harnesses.offline_litellm import litellm_model_name, offline_litellm

#: mini-swe-agent's exit statuses and what they mean for an episode.
_FINISH_REASONS = {"Submitted": "complete", "LimitsExceeded": "max_turns",
                   "RepeatedFormatError": "format_errors"}


class MiniSweAgentHarness(Harness):
    """mini-swe-agent's `DefaultAgent` on the episode's sandbox and gateway."""

    name = "mini_swe_agent"

    async def run(self, context: HarnessContext) -> HarnessOutcome:
        mini = _import_mini_swe_agent()
        config = mini["config"]
        wall_time_s = int(context.remaining_s)
        try:
            model = mini["model_cls"](
                model_name=litellm_model_name(context.model),
                **{key: value for key, value in config.get("model", {}).items()
                   if key != "model_kwargs"},
                model_kwargs={**config.get("model", {}).get("model_kwargs", {}),
                              "api_base": context.base_url, "api_key": context.api_key,
                              "timeout": max(1, wall_time_s)},
                cost_tracking="ignore_errors",
            )
            environment = mini["environment_cls"](context.terminal, asyncio.get_running_loop(),
                                                  context.deadline, **config.get("environment", {}))
            agent = mini["agent_cls"](
                model, environment,
                **{**config.get("agent", {}), "step_limit": context.max_turns,
                   "wall_time_limit_seconds": max(1, wall_time_s),
                   "output_path": context.work_dir / "mini-swe-agent.traj.json"},
            )
        except Exception as exc:  # its own config checks (pydantic)
            raise HarnessError(f"mini-swe-agent could not start: {type(exc).__name__}: "
                               f"{exc}") from exc
        await environment.describe_sandbox()
        work = _in_own_thread(agent.run, context.instruction,
                              name=f"mini-swe-agent {context.episode_id}")
        try:
            exit_info = await asyncio.wait_for(asyncio.shield(work), context.remaining_s)
        except TimeoutError:
            environment.stopped.set()  # its next command raises; the thread then ends
            raise HarnessTimeout(f"mini-swe-agent did not finish within the episode's time "
                                 f"limit (agent timeout; {agent.n_calls} model calls)") from None
        except asyncio.CancelledError:
            environment.stopped.set()
            raise
        except Exception as exc:
            raise HarnessError(f"mini-swe-agent failed: {type(exc).__name__}: {exc}") from exc
        status = str(exit_info.get("exit_status", ""))
        if status == "TimeExceeded":
            raise HarnessTimeout(f"mini-swe-agent stopped at its wall-time limit "
                                 f"({wall_time_s} s; agent timeout) after {agent.n_calls} calls")
        if status not in _FINISH_REASONS:
            raise HarnessError(f"mini-swe-agent ended with exit status {status!r}")
        return HarnessOutcome(_FINISH_REASONS[status], f"{status} after {agent.n_calls} calls")


def _in_own_thread(func: Callable[..., Any], *args: Any, name: str) -> asyncio.Future[Any]:
    """`func(*args)` on a thread of its own, as a future of this loop. Not the loop's default
    executor: an agent holds its thread for the whole episode, and a few of them would starve
    everything else the service runs there (sandbox file operations, cgroup removal)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()
    # Left running past a deadline or a cancellation, its end (often the gateway refusing the
    # dead key) is no one's to report.
    future.add_done_callback(lambda done: done.cancelled() or done.exception())

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    def target() -> None:
        result, error = None, None
        try:
            result = func(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop closed first (service shutdown)
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=target, name=name, daemon=True).start()
    return future


def _import_mini_swe_agent() -> dict[str, Any]:
    # Read at import: no banner on stdout, and no user-wide config (.env with keys and a
    # default model) mixed into a training run.
    os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
    os.environ.setdefault("MSWEA_GLOBAL_CONFIG_DIR",
                          str(Path(tempfile.gettempdir()) / "riptide-mini-swe-agent"))
    try:
        offline_litellm()
        import yaml
        from minisweagent.agents.default import DefaultAgent
        from minisweagent.config import builtin_config_dir
        from minisweagent.models.litellm_textbased_model import LitellmTextbasedModel

        from services.sandbox.harnesses.mini_swe_environment import SandboxMiniEnvironment
    except ImportError as exc:
        raise HarnessError(f"the mini_swe_agent harness needs mini-swe-agent ({exc}): install "
                           "the extra with `pip install 'riptide[mini-swe-agent]'`") from exc
    config = yaml.safe_load((builtin_config_dir / "default.yaml").read_text())
    return {"config": config, "agent_cls": DefaultAgent, "model_cls": LitellmTextbasedModel,
            "environment_cls": SandboxMiniEnvironment}
