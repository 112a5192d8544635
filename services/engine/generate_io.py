"""SGLang's `/generate` body in and response out: parsing (single or batched) and meta_info."""

from __future__ import annotations

import time
from typing import Any

from services.common.errors import InvalidRequest
from services.engine.model_runner import ModelRunner
from services.engine.request import GenRequest, SamplingParams, Update
from services.engine.stopping import output_text

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
}
# Fields that only matter to other components (router, disaggregation, logging): accepted.
_IGNORED = {
    "routing_key",
    "priority",
    "log_metrics",
    "extra_key",
    "no_logs",
    "custom_labels",
    "conversation_id",
    "background",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "bootstrap_pair_key",
    "session_params",
    "return_hidden_states",
    "lora_id",
    "lora_path",
    "modalities",
    "image_data",
    "video_data",
    "audio_data",
    "input_embeds",
    "custom_logit_processor",
    "token_ids_logprob",
    "return_entropy",
    "return_bytes",
}


def _need_neutral(body: dict[str, Any]) -> None:
    for key in (
        "lora_path",
        "lora_id",
        "image_data",
        "video_data",
        "audio_data",
        "input_embeds",
        "custom_logit_processor",
        "token_ids_logprob",
        "session_params",
    ):
        if body.get(key):
            raise InvalidRequest(f"{key} is not supported by the built-in engine")
    if body.get("return_hidden_states") or body.get("return_entropy"):
        raise InvalidRequest("hidden states and entropy are not returned by the built-in engine")
    if body.get("top_logprobs_num"):
        raise InvalidRequest("top_logprobs_num is not supported by the built-in engine")


def _pick(value: Any, index: int, batched: bool) -> Any:
    return value[index] if batched and isinstance(value, list) else value


def parse_generate(
    body: Any, runner: ModelRunner, dp_size: int = 1
) -> tuple[list[GenRequest], bool]:
    """Turn a `/generate` body into requests; returns (requests, whether the input was a batch)."""
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object")
    unknown = sorted(set(body) - _USED - _IGNORED)
    if unknown:
        raise InvalidRequest(f"unknown fields: {', '.join(unknown)}")
    _need_neutral(body)
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
    if batched and body.get("stream"):
        raise InvalidRequest("stream is supported for a single prompt only")
    rids = body.get("rid")
    if batched and rids is not None and (not isinstance(rids, list) or len(rids) != len(prompts)):
        raise InvalidRequest("rid must be a list as long as the batch")
    dp_rank = body.get("routed_dp_rank", body.get("data_parallel_rank"))
    if dp_rank is not None and (not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_size):
        raise InvalidRequest(f"routed_dp_rank {dp_rank!r} out of range: dp_size is {dp_size}")
    requests = []
    for i, prompt in enumerate(prompts):
        _check_prompt(prompt, runner)
        params = SamplingParams.parse(_pick(body.get("sampling_params"), i, batched))
        req = GenRequest(
            input_ids=list(prompt),
            params=params,
            return_logprob=bool(_pick(body.get("return_logprob"), i, batched)),
            logprob_start_len=int(_pick(body.get("logprob_start_len", -1), i, batched)),
            stream=bool(body.get("stream")),
            dp_rank=dp_rank,
        )
        rid = _pick(rids, i, batched)
        if rid is not None:
            req.rid = str(rid)
        requests.append(req)
    return requests, batched


def _check_prompt(prompt: Any, runner: ModelRunner) -> None:
    if not isinstance(prompt, list) or not prompt:
        raise InvalidRequest("input_ids must be a non-empty list of token ids")
    if not all(isinstance(t, int) and 0 <= t < runner.vocab_size for t in prompt):
        raise InvalidRequest(f"input_ids must be integers in [0, {runner.vocab_size})")
    if len(prompt) >= runner.context_len:
        raise InvalidRequest(
            f"the input ({len(prompt)} tokens) is longer than the model's context length "
            f"({runner.context_len} tokens)"
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
    text = output_text(update.output_ids, update.finish_reason, req.params, runner)
    return {"text": text, "output_ids": update.output_ids, "meta_info": meta}
