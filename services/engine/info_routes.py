"""The built-in engine's read-only routes: model and server facts, loads, weights by name,
tokenize and detokenize, under the route names of the contract it serves.

`current` serves SGLang 0.5.23's names (`/model_info`, `/server_info`, `/v1/loads`) and the
deprecated aliases 0.5.23 keeps (`/get_model_info`, `/get_server_info`, `/get_load`);
`deprecated` serves only the older names, plus `/get_weight_version` of the oldest trees, so
clients can be tested against an engine that knows nothing newer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request

from services.common.errors import InvalidRequest
from services.engine.engine import Engine

VERSION = "riptide-engine-0.2.0"
CONTRACT_VERSION = {"current": "0.5.23", "deprecated": "pre-0.5.23"}


async def read_json(request: Request) -> Any:
    import json

    raw = await request.body()
    if not raw:
        return {}
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"the body is not valid JSON: {exc}") from None


def add_info_routes(app: FastAPI, engine: Engine) -> None:
    """Register the read-only routes for `engine.config.contract`."""
    cfg = engine.config
    current = cfg.contract == "current"

    def get(*paths: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def register(fn: Callable[..., Any]) -> Callable[..., Any]:
            for path in paths:
                app.get(path)(fn)
            return fn
        return register

    def model_info() -> dict[str, Any]:
        return {
            "model_path": cfg.model_path,
            "tokenizer_path": cfg.tokenizer_path or cfg.model_path,
            "is_generation": True,
            "weight_version": engine.weight_version,
            "preferred_sampling_params": None,
            "served_model_name": engine.model_name,
            "load_format": "auto",
            "model_type": getattr(engine.runner.model.config, "model_type", None),
            "architectures": getattr(engine.runner.model.config, "architectures", None),
        }

    async def server_info() -> dict[str, Any]:
        states = await engine.run(engine.server_state)
        return {
            **cfg.model_dump(exclude={"api_key"}),  # a secret: never in an answer
            "model_path": cfg.model_path,
            "served_model_name": engine.model_name,
            "tp_size": 1,
            "pp_size": 1,
            "dp_size": cfg.dp_size,
            "enable_dp_attention": cfg.dp_size > 1,
            "page_size": 1,
            "skip_tokenizer_init": False,
            "max_total_num_tokens": cfg.max_total_num_tokens,
            "max_req_input_len": engine.runner.context_len - 1,
            "context_length": engine.runner.context_len,
            "weight_version": engine.weight_version,
            "memory_released": sorted(engine.memory.released),
            "memory_usage": await engine.run(engine.memory.usage),
            "shared_tensors": engine.shared_tensors.stats(),
            "last_weight_load": engine.runner.last_load,
            "internal_states": states,
            "version": VERSION,
            "sglang_contract": CONTRACT_VERSION[cfg.contract],
        }

    # Loads are read from the request thread, not queued for the loop thread between steps:
    # they are counters (a step may be a moment ahead of them), and the fleet takes a load
    # that waits behind a long CPU step for a missed health check of a hung engine.
    async def old_load() -> list[dict[str, Any]]:
        return [s.load() for s in engine.schedulers]

    async def loads() -> dict[str, Any]:
        def read() -> list[dict[str, Any]]:
            capacity = cfg.max_total_num_tokens
            return [{"dp_rank": s.dp_rank, "num_running_reqs": len(s.running),
                     "num_waiting_reqs": len(s.waiting), "num_used_tokens": s.num_used_tokens,
                     "max_total_num_tokens": capacity,
                     "token_usage": s.num_used_tokens / capacity} for s in engine.schedulers]
        return {"timestamp": time.time(), "version": VERSION, "loads": read()}

    if current:
        get("/model_info", "/get_model_info")(model_info)
        get("/server_info", "/get_server_info")(server_info)
        get("/v1/loads")(loads)
        get("/get_load")(old_load)
    else:
        get("/get_model_info")(model_info)
        get("/get_server_info")(server_info)
        get("/get_load")(old_load)

        @app.get("/get_weight_version")
        async def get_weight_version() -> dict[str, Any]:
            return {"weight_version": engine.weight_version}

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(request: Request) -> Any:
        body = dict(request.query_params) if request.method == "GET" else {}
        body.update(await read_json(request) or {})
        name, truncate = body.get("name"), int(body.get("truncate_size", 100))
        if not isinstance(name, str):
            raise InvalidRequest("name (a Hugging Face parameter name) is required")

        def read() -> Any:
            param = engine.runner.checkpoint_names.view(name)
            if param is None:
                raise InvalidRequest(f"Get parameter by name failed: unknown parameter {name!r}")
            return param.detach().float().cpu()[:truncate].tolist()
        return await engine.run(read)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await read_json(request)
        prompt, special = body.get("prompt"), bool(body.get("add_special_tokens", True))
        tok = engine.runner.tokenizer
        if isinstance(prompt, str):
            ids = tok.encode(prompt, add_special_tokens=special)
            return {"tokens": ids, "count": len(ids), "max_model_len": engine.runner.context_len}
        if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
            many = [tok.encode(p, add_special_tokens=special) for p in prompt]
            return {"tokens": many, "count": [len(i) for i in many],
                    "max_model_len": engine.runner.context_len}
        raise InvalidRequest("prompt must be a string or a list of strings")

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await read_json(request)
        tokens, skip = body.get("tokens"), bool(body.get("skip_special_tokens", True))
        if isinstance(tokens, list) and all(isinstance(t, int) for t in tokens):
            return {"text": engine.runner.decode_text(tokens, skip)}
        if isinstance(tokens, list) and all(isinstance(t, list) for t in tokens):
            return {"text": [engine.runner.decode_text(t, skip) for t in tokens]}
        raise InvalidRequest("tokens must be a list of token ids or a list of such lists")
