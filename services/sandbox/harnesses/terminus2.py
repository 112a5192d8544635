"""Harbor's Terminus-2, run unchanged: its own agent code, its tmux session, its parser.

Terminus-2 (the reference agent of terminal-bench-2) answers each turn with JSON: an
analysis, a plan, keystrokes with durations, and `task_complete`, which it must confirm on
the next turn. Harbor drives a tmux session in the task's container; here that container is
the episode's sandbox (harbor_environment.py) and the model is the episode's gateway, reached
through litellm (`openai/<model>` at the gateway's base URL with the episode's key). Harbor's
own verifier and trial machinery are not used: the sandbox service scores the episode with
the task's tests as for every agent.

Needs the `terminus2` extra (harbor 0.25, which requires Python >= 3.12). Terminal recording
(asciinema) is off: it would be installed from the internet, which sandboxes cannot reach.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

from services.common.errors import RiptideError
from services.sandbox.harness import (
    Harness,
    HarnessContext,
    HarnessError,
    HarnessOutcome,
    HarnessTimeout,
)
from services.sandbox.harnesses.offline_litellm import litellm_model_name, offline_litellm

log = logging.getLogger(__name__)
_MARK_COMPLETE = "mark_task_complete"


class Terminus2Harness(Harness):
    """Harbor's `Terminus2` agent on the episode's sandbox and gateway."""

    name = "terminus2"

    async def run(self, context: HarnessContext) -> HarnessOutcome:
        agent_cls, agent_context_cls, environment_cls = _import_harbor()
        logs_dir = context.work_dir / "terminus2"
        logs_dir.mkdir(parents=True, exist_ok=True)
        try:
            environment = environment_cls(context.terminal, context.task,
                                          context.work_dir / "trial", context.deadline,
                                          session_id=context.episode_id)
            agent = agent_cls(
                logs_dir=logs_dir, model_name=litellm_model_name(context.model),
                api_base=context.base_url, llm_kwargs={"api_key": context.api_key},
                max_turns=context.max_turns, suppress_max_turns_warning=True,
                record_terminal_session=False, session_id=context.episode_id,
            )
        except Exception as exc:
            raise HarnessError(f"terminus2 could not start: {type(exc).__name__}: {exc}") from exc
        agent_context = agent_context_cls()
        deadline = asyncio.timeout(context.remaining_s)
        try:
            async with deadline:
                await environment.start(force_build=False)
                await agent.setup(environment)
                await agent.run(context.instruction, environment, agent_context)
        except TimeoutError as exc:
            if not deadline.expired():
                raise HarnessError(f"terminus2 failed: TimeoutError: {exc}") from exc
            raise HarnessTimeout(
                f"terminus2 did not finish within the episode's time limit "
                f"(agent timeout; {len(_agent_steps(logs_dir))} turns taken)") from None
        except RiptideError:
            raise
        except Exception as exc:
            raise HarnessError(f"terminus2 failed: {type(exc).__name__}: {exc}") from exc
        finally:
            await asyncio.shield(environment.stop(delete=False))
        turns = int((agent_context.metadata or {}).get("n_episodes", 0))
        return _outcome(_agent_steps(logs_dir), turns, context.max_turns)


def _import_harbor() -> tuple[Any, Any, Any]:
    try:
        offline_litellm()
        from harbor.agents.terminus_2 import Terminus2
        from harbor.models.agent.context import AgentContext

        from services.sandbox.harnesses.harbor_environment import SandboxEnvironment
    except ImportError as exc:
        raise HarnessError(
            f"the terminus2 harness needs Harbor ({exc}): install the extra with "
            "`pip install 'riptide[terminus2]'` (harbor 0.25 requires Python >= 3.12)"
        ) from exc
    return Terminus2, AgentContext, SandboxEnvironment


def _agent_steps(logs_dir: Path) -> list[dict[str, Any]]:
    """The agent's turns from the trajectory Terminus-2 writes (Harbor's ATIF format)."""
    path = logs_dir / "trajectory.json"
    if not path.is_file():
        return []
    steps = json.loads(path.read_text()).get("steps", [])
    return [step for step in steps if step.get("source") == "agent"]


def _outcome(steps: list[dict[str, Any]], turns: int, max_turns: int) -> HarnessOutcome:
    """Complete only when the agent marked the task complete twice in a row (its confirmation)."""
    marked = [any(call.get("function_name") == _MARK_COMPLETE
                  for call in step.get("tool_calls") or []) for step in steps]
    if len(marked) >= 2 and marked[-1] and marked[-2]:
        return HarnessOutcome("complete", f"task_complete confirmed after {turns} turns")
    if turns >= max_turns:
        return HarnessOutcome("max_turns", f"{turns} turns without a confirmed task_complete")
    return HarnessOutcome("session_ended", f"the tmux session ended after {turns} turns")
