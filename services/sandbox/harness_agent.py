"""The agent of an episode run by a black-box harness behind the agent gateway.

Opens the episode's gateway session (its base URL and key), gives the harness a terminal onto
the sandbox, runs it within the episode's wall time, closes the session (the key dies), and
turns what the gateway captured into the episode's tokens: one segment, or several where the
harness's history did not extend. How it ended: the harness's own word (`complete` ...), or
the cap it ran into at the gateway (`max_turns`, `context_length`, `wall_time`: the episode is
then verified as the built-in agent's would be). A harness that crashes, or does not return in
time, leaves the episode without a verdict (HarnessError, HarnessTimeout); so does a turn the
engine aborted. Called by the episode runner (episode.py) in place of TerminalAgent.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from services._proto.riptide.v1 import common_pb2
from services.common.events import OBSERVATION_MAX_CHARS
from services.sandbox.agent import AgentRun, GenerationAborted, ProgressFn
from services.sandbox.config import AgentConfig
from services.sandbox.gateway.server import AgentGateway
from services.sandbox.gateway.session import GatewaySession, SessionLimits
from services.sandbox.harness import (
    Harness,
    HarnessContext,
    HarnessError,
    HarnessTimeout,
    SandboxTerminal,
)
from services.sandbox.provider import ExecResult, SandboxHandle, SandboxProvider
from services.sandbox.task import Task

log = logging.getLogger(__name__)

#: A harness gets this long past the episode's deadline to notice and return.
_GRACE_S = 10.0


class HarnessAgent:
    """Runs one episode's harness against the gateway and a sandbox terminal."""

    def __init__(self, harness: Harness, gateway: AgentGateway, provider: SandboxProvider,
                 config: AgentConfig, work_root: str | None = None) -> None:
        self.harness = harness
        self.gateway = gateway
        self.provider = provider
        self.config = config
        self.work_root = work_root

    @property
    def tokenizer(self) -> Any:
        return self.gateway.tokenizer

    async def run(self, handle: SandboxHandle, instruction: str, session_key: str,
                  sampling: common_pb2.SamplingParams, wall_time_s: float,
                  on_progress: ProgressFn | None = None, task: Task | None = None,
                  route_shape: tuple[int, int] | None = None) -> AgentRun:
        """The harness's whole episode; the gateway session lives exactly this long."""
        if task is None:
            raise HarnessError("a harness needs the episode's task")
        progress = on_progress or (lambda kind, turn, detail: None)
        limits = self.config
        deadline = time.monotonic() + min(wall_time_s, limits.wall_time_s)
        session = self.gateway.open(session_key, sampling, SessionLimits(
            limits.max_turns, limits.max_context_tokens, limits.max_new_tokens, deadline),
            route_shape=route_shape)
        exec_s = [0.0]

        def on_command(command: str, result: ExecResult) -> None:
            exec_s[0] += result.duration_s
            status = "timed out" if result.timed_out else f"exit {result.exit_code}"
            progress("command", session.num_calls, f"{status}: {command[:80]}")
            if session.turns:
                turn = session.turns[-1]
                turn["commands"].append(command)
                turn["observation"] = (turn["observation"] + result.output)[
                    -OBSERVATION_MAX_CHARS:]

        work_dir = Path(tempfile.mkdtemp(prefix=f"riptide-{self.harness.name}-",
                                         dir=self.work_root))
        context = HarnessContext(
            episode_id=session_key, base_url=self.gateway.base_url(session_key),
            api_key=session.key, model=self.gateway.model_name, instruction=instruction,
            task=task, terminal=SandboxTerminal(self.provider, handle, on_command),
            max_turns=limits.max_turns, deadline=deadline, work_dir=work_dir)
        try:
            finish_reason = await self._run_harness(context, session, deadline)
        finally:
            self.gateway.close(session_key)
            shutil.rmtree(work_dir, ignore_errors=True)
        if session.aborted:
            raise GenerationAborted(f"the engine aborted a call of {session_key}")
        return _agent_run(session, finish_reason, exec_s[0])

    async def _run_harness(self, context: HarnessContext, session: GatewaySession,
                           deadline: float) -> str:
        try:
            outcome = await asyncio.wait_for(
                self.harness.run(context), max(0.0, deadline - time.monotonic()) + _GRACE_S)
        except TimeoutError:
            if session.limit_hit:
                return session.limit_hit
            raise HarnessTimeout(f"{self.harness.name} did not return within the episode's "
                                 f"wall time ({session.num_calls} calls made)") from None
        except (HarnessError, HarnessTimeout):  # a harness may see its deadline first
            if session.limit_hit:  # it gave up on our refusal: the episode ended at a cap
                return session.limit_hit
            raise
        except Exception as exc:  # noqa: BLE001 - third-party code: any crash is a harness error
            if session.limit_hit:
                return session.limit_hit
            log.warning("harness %s crashed in %s", self.harness.name, context.episode_id,
                        exc_info=True)
            raise HarnessError(f"{self.harness.name} crashed: {type(exc).__name__}: "
                               f"{str(exc)[:300]}") from exc
        return session.limit_hit or outcome.finish_reason


def _agent_run(session: GatewaySession, finish_reason: str, exec_s: float) -> AgentRun:
    segments = session.trace.segments
    if not segments:
        raise HarnessError("the harness made no model call")
    run = AgentRun(segments[0], extra_segments=segments[1:], num_turns=session.num_calls,
                   finish_reason=finish_reason, generate_s=session.generate_s, exec_s=exec_s,
                   turns=session.turns, prompt_tokens=session.prompt_tokens,
                   cached_tokens=session.cached_tokens)
    if session.last is not None:
        run.engine_url, run.dp_rank = session.last.engine_url, session.last.dp_rank
    return run
