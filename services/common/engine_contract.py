"""Which SGLang HTTP contract an engine speaks, and reading its facts the same way for all.

SGLang 0.5.23 serves `/model_info`, `/server_info` and `/v1/loads`; older trees (and the
deprecated aliases newer trees keep) serve `/get_model_info`, `/get_server_info` and
`/get_load`, and the oldest read the weight version from `/get_weight_version`. The client
learns the contract once per engine (current routes first, deprecated ones as fallback), then
falls back per route: an engine on the current info routes may still serve its load only on
`/get_load`. Every reader below turns either shape into the same facts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

ContractMode = Literal["current", "deprecated"]
RouteName = Literal["model_info_path", "server_info_path", "load_path"]

# (current route, deprecated route) of each fact the client reads.
MODEL_INFO = ("/model_info", "/get_model_info")
SERVER_INFO = ("/server_info", "/get_server_info")
LOADS = ("/v1/loads", "/get_load")
OLD_WEIGHT_VERSION = "/get_weight_version"
_PAIRS: dict[str, tuple[str, str]] = {"model_info_path": MODEL_INFO,
                                      "server_info_path": SERVER_INFO, "load_path": LOADS}
#: Where a launcher puts the key (SGLang's --api-key) of the built-in engine it starts, never
#: on its command line, which every local user can read in /proc.
API_KEY_ENV = "RIPTIDE_ENGINE_API_KEY"


def bearer(api_key: str | None) -> dict[str, str]:
    """The header every client of an engine sends (none when no key is configured)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


@dataclass(frozen=True)
class EngineContract:
    """The routes one engine answers, learned when it registers."""

    mode: ContractMode
    model_info_path: str
    server_info_path: str
    load_path: str
    sglang_version: str

    @classmethod
    def of(cls, mode: ContractMode, sglang_version: str = "") -> EngineContract:
        pick = 0 if mode == "current" else 1
        return cls(mode, MODEL_INFO[pick], SERVER_INFO[pick], LOADS[pick], sglang_version)

    def candidates(self, route: RouteName) -> tuple[str, ...]:
        """The paths of `route` to try: the one this contract uses, then the other one."""
        path = getattr(self, route)
        return (path, *(p for p in _PAIRS[route] if p != path))

    def serving(self, route: RouteName, path: str) -> EngineContract:
        """This contract with `route` read from `path` (a per-route fallback)."""
        if route == "model_info_path":
            return replace(self, model_info_path=path)
        if route == "server_info_path":
            return replace(self, server_info_path=path)
        return replace(self, load_path=path)


@dataclass(frozen=True)
class EngineLoad:
    """The load of one dp rank, whatever route reported it."""

    dp_rank: int
    num_reqs: int
    num_waiting_reqs: int
    num_tokens: int

    def view(self) -> dict[str, int]:
        return {"dp_rank": self.dp_rank, "num_reqs": self.num_reqs,
                "num_waiting_reqs": self.num_waiting_reqs, "num_tokens": self.num_tokens}


def _int(value: Any) -> int:
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0


def parse_loads(body: Any) -> list[EngineLoad]:
    """Per-rank loads from `/v1/loads` (`{"loads": [...]}`) or `/get_load` (a list, or one dict).

    `/v1/loads` counts running and waiting requests apart and names used KV tokens
    `num_used_tokens`; `/get_load` has `num_reqs` (running + waiting) and `num_tokens`.
    """
    if isinstance(body, dict) and isinstance(body.get("loads"), list):
        body = body["loads"]
    items = body if isinstance(body, list) else [body]
    loads = []
    for index, item in enumerate(i for i in items if isinstance(i, dict)):
        waiting = _int(item.get("num_waiting_reqs"))
        if "num_reqs" in item:
            reqs = _int(item["num_reqs"])
        else:
            reqs = _int(item.get("num_running_reqs")) + waiting
        tokens = item.get("num_tokens", item.get("num_used_tokens"))
        if tokens is None and "token_usage" in item and "max_total_num_tokens" in item:
            tokens = float(item["token_usage"]) * _int(item["max_total_num_tokens"])
        loads.append(EngineLoad(_int(item.get("dp_rank", index)), reqs, waiting, _int(tokens)))
    return loads


def weight_version_of(body: Any) -> str | None:
    """The weight version in a `/model_info` or `/get_weight_version` answer, if any."""
    if isinstance(body, dict) and body.get("weight_version") is not None:
        return str(body["weight_version"])
    if isinstance(body, str) and body:
        return body
    return None


def sglang_version_of(server_info: Any) -> str:
    """SGLang's version string from `/server_info` ('' when it does not say)."""
    if isinstance(server_info, dict):
        return str(server_info.get("version") or "")
    return ""


def error_message(body: Any, fallback: str = "") -> str:
    """The message of any of SGLang's error shapes.

    `{"error": {"message": ...}}` (0.5.23 /generate and control routes), `{"error": "..."}`
    (schema violations), `{"object": "error", "message": ...}` (FastAPI handlers),
    `{"success": false, "message": ...}` (weight routes), `{"detail": ...}` (plain FastAPI).
    """
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            return str(err.get("message", err))
        if isinstance(err, str):
            return err
        for key in ("message", "detail"):
            if body.get(key):
                return str(body[key])
        return str(body)[:500]
    if isinstance(body, str):
        return body[:500]
    return fallback


def weight_version_spans(meta: dict[str, Any], num_tokens: int) -> list[str]:
    """The weight version of each of `num_tokens` output tokens.

    From `meta_info.weight_versions` (half-open `[start, end)` spans of output tokens, each
    with its `version`) where the engine gives them; else every token gets the single
    `meta_info.weight_version`. Tokens no span covers take the nearest earlier span's version.
    """
    spans = meta.get("weight_versions")
    single = meta.get("weight_version")
    fallback = "" if single is None else str(single)
    if not isinstance(spans, list) or not spans:
        return [fallback] * num_tokens
    versions = [fallback] * num_tokens
    ordered = sorted((s for s in spans if isinstance(s, dict)), key=lambda s: _int(s.get("start")))
    for span in ordered:
        start, end = max(0, _int(span.get("start"))), min(num_tokens, _int(span.get("end")))
        version = str(span.get("version", fallback))
        for i in range(start, end):
            versions[i] = version
        if end < num_tokens and span is ordered[-1]:
            for i in range(end, num_tokens):
                versions[i] = version
    return versions
