"""Failure classes: why an episode has no verdict, decided where the failure is detected.

Every missing verdict carries one `NoVerdictCause` (common.proto). The episode runner
(episode.py) classifies what its phases raise with `cause_of`: a failed create is the
provider's, a `SandboxError` after it means the sandbox was lost, an `EngineError` or
`ContextOverflow` comes from the model client (agent.py wraps the router's errors), a hard
agent deadline is an agent timeout, and anything else the agent raises is an agent/harness
error (the runner turns any other exception of the agent into `AgentError`). The verifier
(verifier.py) sets its own causes on its `Verdict`. The rollout service marks an episode
whose RunEpisode call failed as sandbox lost (agent timeout past the call's deadline).
"""

from __future__ import annotations

from typing import Literal

from services._proto.riptide.v1 import common_pb2
from services.common.errors import InvalidRequest, RiptideError, Unavailable
from services.sandbox.provider import SandboxError

Phase = Literal["create", "agent", "verify"]
Cause = common_pb2.NoVerdictCause

PROVIDER_CREATE_FAILED = common_pb2.NO_VERDICT_CAUSE_PROVIDER_CREATE_FAILED
SANDBOX_LOST = common_pb2.NO_VERDICT_CAUSE_SANDBOX_LOST
AGENT_TIMEOUT = common_pb2.NO_VERDICT_CAUSE_AGENT_TIMEOUT
AGENT_ERROR = common_pb2.NO_VERDICT_CAUSE_AGENT_ERROR
CONTEXT_OVERFLOW = common_pb2.NO_VERDICT_CAUSE_CONTEXT_OVERFLOW
VERIFIER_ERROR = common_pb2.NO_VERDICT_CAUSE_VERIFIER_ERROR
VERIFIER_TIMEOUT = common_pb2.NO_VERDICT_CAUSE_VERIFIER_TIMEOUT
ENGINE_ERROR = common_pb2.NO_VERDICT_CAUSE_ENGINE_ERROR

#: Words of an engine's refusal of a prompt longer than its context (SGLang and ours).
_CONTEXT_WORDS = ("context length", "maximum context")


class EngineError(Unavailable):
    """A model turn could not be generated (router or engine failure, an aborted turn)."""


class ContextOverflow(InvalidRequest):
    """The engine refused the prompt as longer than its context window."""


class AgentError(RiptideError):
    """The agent or harness itself failed (crashed, or broke its protocol)."""


class AgentTimeout(RiptideError):
    """The agent ran past its wall time plus the grace it has to stop by itself."""


def model_error(exc: RiptideError) -> RiptideError:
    """The failure class of an error of the model client: a context refusal or an engine
    error (what the agent raises in their place)."""
    text = str(exc).lower()
    if isinstance(exc, InvalidRequest) and any(word in text for word in _CONTEXT_WORDS):
        return ContextOverflow(str(exc))
    return EngineError(str(exc))


def cause_of(exc: BaseException, phase: Phase) -> Cause:
    """The cause of a missing verdict from what a phase of the episode raised."""
    if phase == "create":
        return PROVIDER_CREATE_FAILED
    if isinstance(exc, SandboxError):
        return SANDBOX_LOST
    if isinstance(exc, ContextOverflow):
        return CONTEXT_OVERFLOW
    if isinstance(exc, EngineError):
        return ENGINE_ERROR
    if isinstance(exc, AgentTimeout):
        return AGENT_TIMEOUT
    return VERIFIER_ERROR if phase == "verify" else AGENT_ERROR
