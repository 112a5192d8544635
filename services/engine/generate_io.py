"""SGLang's `/generate` body in and response out: parsing (single or batched) and meta_info."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from services.common.errors import InvalidRequest
from services.engine.model_runner import ModelRunner
from services.engine.request import GenRequest, SamplingParams, Update
from services.engine.stopping import output_text

log = logging.getLogger(__name__)

# GenerateReqInput fields the engine reads.
_USED = {
    "text",
    "input_ids",
    "sampling_params",
    "rid",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_text_in_logprobs",
    "stream",
    "routed_dp_rank",
    "data_parallel_rank",
    "return_routed_experts",
    "routed_experts_start_len",
}
# GenerateReqInput fields the built-in engine cannot honour: a 400 unless they are empty.
_REFUSED = (
    "lora_path",
    "lora_id",
    "image_data",
    "video_data",
    "audio_data",
    "input_embeds",
    "custom_logit_processor",
    "token_ids_logprob",
    "session_params",
    "return_hidden_states",
    "return_entropy",
)
# Everything else is ignored as SGLang ignores unknown fields; each name is logged once.
_logged_unknown: set[str] = set()


def _check_fields(body: dict[str, Any]) -> None:
    for key in _REFUSED:
        if body.get(key):
            raise InvalidRequest(f"{key} is not supported by the built-in engine")
    unknown = set(body) - _USED - set(_REFUSED) - _logged_unknown
    for key in sorted(unknown):
        _logged_unknown.add(key)
        log.warning("ignoring /generate field %r (logged once per field)", key)


def _pick(value: Any, index: int, batched: bool) -> Any:
    return value[index] if batched and isinstance(value, list) else value


def parse_generate(
    body: Any, runner: ModelRunner, dp_size: int = 1
) -> tuple[list[GenRequest], bool]:
    """Turn a `/generate` body into requests; returns (requests, whether the input was a batch)."""
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object")
    _check_fields(body)
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise InvalidRequest("give exactly one of text and input_ids")
    if input_ids is not None:
        batched = bool(input_ids) and isinstance(input_ids[0], list)
        prompts = input_ids if batched else [input_ids]
    else:
        batched = isinstance(text, list)
        texts = text if isinstance(text, list) else [text]
        prompts = [runner.tokenizer.encode(t) for t in texts]
    rids = body.get("rid")
    if batched and rids is not None and (not isinstance(rids, list) or len(rids) != len(prompts)):
        raise InvalidRequest("rid must be a list as long as the batch")
    dp_rank = body.get("routed_dp_rank", body.get("data_parallel_rank"))
    if dp_rank is not None and (not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_size):
        raise InvalidRequest(f"routed_dp_rank {dp_rank!r} out of range: dp_size is {dp_size}")
    requests = []
    for i, prompt in enumerate(prompts):
        params = SamplingParams.parse(_pick(body.get("sampling_params"), i, batched))
        _check_prompt(prompt, params, runner)
        rid = _pick(rids, i, batched)
        # n > 1: a group of samples of one prompt, prompt-major; sample j gets rid "<rid>_<j>"
        # and, when seeded, seed + j, so the samples differ.
        for j in range(params.n):
            sample = params if params.n == 1 else dataclasses.replace(
                params, n=1,
                sampling_seed=None if params.sampling_seed is None else params.sampling_seed + j)
            req = GenRequest(
                input_ids=list(prompt),
                params=sample,
                return_logprob=bool(_pick(body.get("return_logprob"), i, batched)),
                logprob_start_len=int(_pick(body.get("logprob_start_len", -1), i, batched)),
                top_logprobs_num=_top_num(_pick(body.get("top_logprobs_num"), i, batched)),
                stream=bool(body.get("stream")),
                dp_rank=dp_rank,
            )
            _ask_routes(req, body, i, batched, runner)
            if rid is not None:
                req.rid = str(rid) if params.n == 1 else f"{rid}_{j}"
            requests.append(req)
    seen: set[str] = set()
    for req in requests:
        if req.rid in seen:
            raise InvalidRequest(f"Duplicate request ID detected within the same batch: {req.rid}")
        seen.add(req.rid)
    if body.get("stream") and len(requests) > 1:
        raise InvalidRequest("the built-in engine streams one prompt and one sample (n=1) only")
    return requests, batched or len(requests) > 1


def _ask_routes(req: GenRequest, body: dict[str, Any], index: int, batched: bool,
                runner: ModelRunner) -> None:
    """`return_routed_experts` and `routed_experts_start_len` of one request."""
    req.return_routed_experts = bool(_pick(body.get("return_routed_experts"), index, batched))
    if not req.return_routed_experts:
        return
    if runner.routed_experts is None:
        raise InvalidRequest("return_routed_experts needs an engine started with "
                             "--enable-return-routed-experts (and an MoE model)")
    start = _pick(body.get("routed_experts_start_len", 0), index, batched)
    if not isinstance(start, int) or not 0 <= start < len(req.input_ids):
        raise InvalidRequest(f"routed_experts_start_len must be an integer in "
                             f"[0, {len(req.input_ids)}), got {start!r}")
    req.routed_experts_start_len = start


def _top_num(value: Any) -> int:
    if value in (None, 0):
        return 0
    if not isinstance(value, int) or value < 0:
        raise InvalidRequest(f"top_logprobs_num must be a non-negative integer, got {value!r}")
    return value


def _check_prompt(prompt: Any, params: SamplingParams, runner: ModelRunner) -> None:
    if not isinstance(prompt, list) or not prompt:
        raise InvalidRequest("input_ids must be a non-empty list of token ids")
    if not all(isinstance(t, int) and 0 <= t < runner.vocab_size for t in prompt):
        raise InvalidRequest(f"input_ids must be integers in [0, {runner.vocab_size})")
    if any(not 0 <= t < runner.vocab_size for t in params.logit_bias):
        raise InvalidRequest(f"logit_bias token ids must be in [0, {runner.vocab_size})")
    context = runner.context_len
    if len(prompt) >= context:
        raise InvalidRequest(
            f"The input ({len(prompt)} tokens) is longer than the model's context length "
            f"({context} tokens)."
        )
    if params.explicit_max_new_tokens and len(prompt) + params.max_new_tokens >= context:
        total = len(prompt) + params.max_new_tokens
        raise InvalidRequest(
            f"Requested token count exceeds the model's maximum context length of {context} "
            f"tokens. You requested a total of {total} tokens: {len(prompt)} tokens from the "
            f"input messages and {params.max_new_tokens} tokens for the completion. Please "
            "reduce the number of tokens in the input messages or the completion to fit "
            "within the limit."
        )


def build_response(
    req: GenRequest, update: Update, runner: ModelRunner, text_in_logprobs: bool = False
) -> dict[str, Any]:
    """The SGLang response for `req` at `update` (cumulative output so far)."""
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": update.finish_reason,
        "prompt_tokens": len(req.input_ids),
        "completion_tokens": len(update.output_ids),
        "cached_tokens": update.cached_tokens,
        "weight_version": update.weight_version,
        "e2e_latency": time.perf_counter() - req.created_at,
        "total_retractions": update.num_retractions,
    }
    # Spans of output tokens by the weights that produced them; the single weight_version is
    # the newest span's, as in SGLang.
    spans = update.weight_versions or [(update.weight_version, 0, 0)]
    meta["weight_versions"] = [{"version": v, "start": a, "end": b} for v, a, b in spans]
    meta["weight_version"] = spans[-1][0]
    if req.return_logprob:

        def entry(logprob: float | None, token: int) -> list[Any]:
            shown = runner.decode_text([token], False) if text_in_logprobs else None
            return [logprob, token, shown]

        meta["output_token_logprobs"] = [
            entry(lp, tok) for lp, tok in zip(update.logprobs, update.output_ids, strict=True)
        ]
        start = max(req.logprob_start_len, 0)
        meta["input_token_logprobs"] = [
            entry(lp, tok)
            for lp, tok in zip(req.input_logprobs or [], req.input_ids[start:], strict=False)
        ]
        if req.top_logprobs_num:
            meta["output_top_logprobs"] = [[entry(lp, t) for lp, t in top]
                                           for top in update.top_logprobs]
            meta["input_top_logprobs"] = [None if top is None else [entry(lp, t) for lp, t in top]
                                          for top in req.input_top_logprobs or []]
    if update.routed_experts is not None:
        meta["routed_experts"] = update.routed_experts
    text = output_text(update.output_ids, update.finish_reason, req.params, runner)
    return {"text": text, "output_ids": update.output_ids, "meta_info": meta}
