"""Size bounds of the strings and ids a request carries, checked at the first service that
receives them (the router for Generate and EndSession, the sandbox for RunEpisode, the rollout
service's dashboard for a sample id), so no oversized value is stored, logged or forwarded.

Ids (session keys, sample, group and task ids, request ids) become dictionary keys, log
fields, Redis keys and SGLang rids: short and printable. Refusals quote at most a prefix.
"""

from __future__ import annotations

from services.common.errors import quote
from services.common.grpc_requests import require

#: Characters of any id: a session key, sample, group, task or request id.
MAX_ID_CHARS = 256
#: Characters of GenerateRequest.sglang_fields_json (SGLang /generate fields passed through).
MAX_SGLANG_FIELDS_CHARS = 64 * 1024


def check_id(name: str, value: str, required: bool = False) -> None:
    """InvalidRequest unless `value` has at most MAX_ID_CHARS printable characters (and is
    set, when `required`)."""
    require(len(value) <= MAX_ID_CHARS and value.isprintable(),
            f"{name}: at most {MAX_ID_CHARS} printable characters, got {quote(value, 40)}")
    require(bool(value) or not required, f"{name} is empty")


def check_prompt_tokens(num_tokens: int, max_input_tokens: int | None) -> None:
    """InvalidRequest when a prompt of `num_tokens` is longer than the engines take
    (`max_input_tokens`, as they report it; None: unknown, not checked)."""
    require(max_input_tokens is None or num_tokens <= max_input_tokens,
            f"input_ids: {num_tokens} tokens, more than the model's context takes "
            f"({max_input_tokens} prompt tokens at most, as the engines report)")
