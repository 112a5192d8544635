"""The gateway's refusals read to the harnesses' client (litellm) as OpenAI's own do: a prompt
over the episode's context is a context-window error, which Terminus-2 answers by summarizing
and mini-swe-agent by stopping, instead of retrying the same call until the deadline."""

from __future__ import annotations

import pytest

from services.sandbox.gateway.openai_shapes import error_body
from services.sandbox.gateway.session import GatewayLimit
from services.sandbox.harnesses.offline_litellm import litellm_model_name
from services.testing.openai_standin import OpenAIStandIn, StandInError

from ..gateway.test_session import RecordingModel, chat, session

pytest.importorskip("litellm", reason="no harness extra is installed (litellm comes with them)")


def _refusal() -> GatewayLimit:
    s = session(RecordingModel([]), max_context_tokens=64)
    with pytest.raises(GatewayLimit) as refused:
        chat(s, [{"role": "user", "content": "x" * 100}])
    return refused.value


def test_a_context_refusal_is_a_context_window_error_to_litellm() -> None:
    from services.sandbox.harnesses.offline_litellm import offline_litellm

    litellm = offline_litellm()
    limit = _refusal()
    body = error_body(str(limit), "invalid_request_error", limit.code)
    with OpenAIStandIn([StandInError(limit.http_status, body)], api_key="k", model="m") as srv:
        with pytest.raises(litellm.ContextWindowExceededError):
            litellm.completion(model=litellm_model_name("m"), api_base=srv.base_url,
                               api_key="k", messages=[{"role": "user", "content": "hi"}],
                               num_retries=0)
        assert len(srv.requests) == 1  # refused once, not retried
