"""One finished episode as the per-sample view shows it: turns, tokens and each token's text.

The sandbox service builds it because it alone holds the turns' text and the tokenizer; the
events publisher calls the builder on its writer thread, so decoding never delays an episode.
The record's fields are `services.common.events.EPISODE_FIELDS`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from services._proto.riptide.v1 import common_pb2
from services.sandbox.agent import AgentRun
from services.sandbox.verifier import Verdict

#: The text of a run of token ids (special tokens kept).
DecodeFn = Callable[[list[int]], str]
#: A UTF-8 character spans at most this many byte-level tokens.
_MAX_CHAR_TOKENS = 4
_INCOMPLETE = "\ufffd"


def token_texts(ids: list[int], decode: DecodeFn) -> list[str]:
    """Each token's text such that they join into the sequence's text: a character split
    over several byte-level tokens is given whole to its last token (the others get ""),
    so the per-token view shows text, never the replacement characters of half a character.
    An invalid byte run is given as decoded after at most `_MAX_CHAR_TOKENS` tokens."""
    out: list[str] = []
    start = 0  # the first token whose text is not yet given
    for end in range(1, len(ids) + 1):
        text = decode(ids[start:end])
        if text.endswith(_INCOMPLETE) and end - start < _MAX_CHAR_TOKENS:
            out.append("")  # the character goes on in the next token
            continue
        out.append(text)
        start = end
    return out


def episode_detail(trajectory: common_pb2.Trajectory, run: AgentRun | None, verdict: Verdict,
                   decode: DecodeFn) -> Callable[[], dict[str, Any]]:
    """A builder of the episode's record. It reads the agent's own token lists (final once the
    episode ended), never the trajectory message, which the servicer is sending meanwhile."""
    verdict_name = common_pb2.VerdictStatus.Name(verdict.status).removeprefix("VERDICT_STATUS_")
    head = {"sample_id": trajectory.sample_id, "group_id": trajectory.group_id,
            "task_id": trajectory.task_id, "reward": verdict.reward,
            "verdict": verdict_name.lower(), "message": verdict.message,
            "finish_reason": trajectory.finish_reason, "engine": trajectory.engine_url,
            "dp_rank": trajectory.dp_rank}

    def build() -> dict[str, Any]:
        trace = run.trace if run is not None else None
        prompt = trace.prompt_ids if trace is not None else []
        ids = prompt + (trace.response_ids if trace is not None else [])
        return {
            **head, "turns": run.turns if run is not None else [],
            "num_prompt_tokens": len(prompt),
            "tokens": {"ids": ids,
                       "loss_mask": [0] * len(prompt) + (trace.loss_mask if trace else []),
                       "logprobs": [0.0] * len(prompt) + (trace.logprobs if trace else [])},
            "token_text": token_texts(ids, decode),
        }

    return build
