"""When a request stops (SGLang's order: length first, then stop tokens, then stop strings)
and the text it returns."""

from __future__ import annotations

from typing import Any, Protocol

from services.engine.request import GenRequest, SamplingParams


class Detokenizer(Protocol):
    eos_token_ids: set[int]
    context_len: int

    def decode_text(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


def check_stop(req: GenRequest, model: Detokenizer) -> dict[str, Any] | None:
    """The finish reason after the newest output token, or None to keep going."""
    params = req.params
    if len(req.output_ids) >= params.max_new_tokens:
        return {"type": "length", "length": params.max_new_tokens}
    if len(req.input_ids) + len(req.output_ids) >= model.context_len:
        return {"type": "length", "length": len(req.output_ids)}
    token = req.output_ids[-1]
    if token in params.stop_token_ids or (not params.ignore_eos and token in model.eos_token_ids):
        return {"type": "stop", "matched": token}
    if params.stop:
        # Only a match ending in the newest token is new; a character spans at most 4 tokens.
        tail = 4 * max(len(stop) for stop in params.stop) + 4
        text = model.decode_text(req.output_ids[-tail:], params.skip_special_tokens)
        for stop in params.stop:
            if stop in text:
                return {"type": "stop", "matched": stop}
    return None


def output_text(
    output_ids: list[int],
    finish_reason: dict[str, Any] | None,
    params: SamplingParams,
    model: Detokenizer,
) -> str:
    """The response text: stop tokens and stop strings trimmed unless `no_stop_trim`."""
    matched = (finish_reason or {}).get("matched") if finish_reason else None
    trim = not params.no_stop_trim and finish_reason is not None
    ids = output_ids[:-1] if trim and isinstance(matched, int) and output_ids else output_ids
    text = model.decode_text(ids, params.skip_special_tokens)
    if trim and isinstance(matched, str) and matched in text:
        text = text[: text.index(matched)]
    return text
