"""The built-in engine's weight routes: the collective group, updates from a broadcast or from
tensors shared by the sender (CUDA IPC handles or shared memory, `tensor_payload`), releasing
and resuming memory for colocated training, the weight version, and the refusals of what it
does not do.

Updates rendezvous, receive and open shared tensors on worker threads so the API stays
responsive; loading (one grouped copy) runs on the engine loop between steps. A payload sent
again unchanged is served from `shared_tensors` (its mappings kept open, its names resolved).
A failed update leaves the old weights in place.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from services.common import tensor_payload
from services.common.errors import InvalidRequest, RiptideError
from services.engine.engine import Engine
from services.engine.info_routes import read_json
from services.engine.memory_occupation import parse_tags
from services.engine.sglang_errors import error_response
from services.engine.shared_tensors import WeightCopy
from services.engine.weight_update import (
    Body,
    DestroyGroupRequest,
    InitGroupRequest,
    UpdateWeightsRequest,
    WeightUpdater,
    parse_body,
)

log = logging.getLogger(__name__)


class TensorUpdateRequest(Body):
    """`/update_weights_from_tensor`: one serialized list of (name, tensor) per TP rank."""

    serialized_named_tensors: list[str]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    disable_draft_model: bool | None = None
    torch_empty_cache: bool = False


class MemoryRequest(Body):
    """`/release_memory_occupation` and `/resume_memory_occupation`."""

    tags: list[str] | None = None


def add_weight_routes(app: FastAPI, engine: Engine, updater: WeightUpdater) -> None:
    update_lock = asyncio.Lock()
    ok = "Succeeded to update parameter online."

    shared = engine.shared_tensors

    async def load(copy: WeightCopy, flush: bool, version: str | None) -> None:
        await engine.run(lambda: engine.load_weights(copy, flush, version))

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request) -> JSONResponse:
        req = parse_body(InitGroupRequest, await read_json(request))
        try:
            await asyncio.to_thread(updater.init_group, req)
        except RiptideError:
            raise
        except Exception as exc:  # rendezvous failures become a precise 400
            msg = f"Failed to init weights update group: {type(exc).__name__}: {exc}"
            return error_response(request.url.path, msg)
        return JSONResponse({"success": True,
                             "message": "Succeeded to initialize custom process group."})

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request) -> JSONResponse:
        req = parse_body(UpdateWeightsRequest, await read_json(request))
        engine.memory.check_weights_resident()
        if req.selector is not None:
            log.info("selector %r: the built-in engine serves one model", req.selector)
        dtypes = updater.validate(req)
        async with update_lock:
            if req.abort_all_requests:
                await engine.run(lambda: engine.abort(None, "aborted for a weight update"))
            await _drain_unless_paused(engine)
            try:
                tensors = await asyncio.to_thread(updater.receive, req, dtypes)
                await load(engine.runner.resolve(tensors), req.flush_cache, req.weight_version)
            except Exception as exc:  # a broken broadcast leaves the old weights in place
                msg = f"Failed to update weights: {type(exc).__name__}: {exc}"
                return error_response(request.url.path, msg)
            finally:
                engine.block_admission = False
        if req.torch_empty_cache and torch.cuda.is_available():
            torch.cuda.empty_cache()
        return JSONResponse({"success": True, "message": ok})

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request) -> JSONResponse:
        req = parse_body(TensorUpdateRequest, await read_json(request))
        if len(req.serialized_named_tensors) != 1:
            raise InvalidRequest("serialized_named_tensors must hold one entry (tp_size is 1), "
                                 f"got {len(req.serialized_named_tensors)}")
        payload = req.serialized_named_tensors[0]
        engine.memory.check_weights_resident()
        started = time.perf_counter()
        async with update_lock:
            engine.memory.check_weights_resident()
            copy = shared.get(req.load_format, payload)
            names: tuple[str, ...] = ()
            tensors: dict[str, torch.Tensor] = {}
            try:
                if copy is None:  # a new payload: unpickle (open handles or files), resolve
                    tensors = await asyncio.to_thread(tensor_payload.decode, payload,
                                                      req.load_format)
                    names, copy = tuple(tensors), engine.runner.resolve(tensors)
                opened = time.perf_counter()
                if req.abort_all_requests:
                    await engine.run(lambda: engine.abort(None, "aborted for a weight update"))
                await _load_when_idle(engine, copy, req.flush_cache, req.weight_version)
                if names:
                    shared.loaded(req.load_format, payload, names, copy)
            finally:  # unless kept, the sender may free its buffer once we answer
                tensors.clear()
                copy = None
        loaded = time.perf_counter()
        if req.torch_empty_cache and torch.cuda.is_available():
            torch.cuda.empty_cache()
        return JSONResponse({"success": True, "message": ok, "open_s": round(opened - started, 6),
                             "load_s": round(loaded - opened, 6)})

    @app.post("/release_memory_occupation")
    async def release_memory_occupation(request: Request) -> dict[str, Any]:
        tags = parse_tags(parse_body(MemoryRequest, await read_json(request)).tags)
        async with update_lock:
            shared.clear()  # its parameter views would keep released weights allocated
            done = await engine.run(lambda: engine.memory.release(tags))
        return {"success": True, "message": f"released {', '.join(tags)}", **done}

    @app.post("/resume_memory_occupation")
    async def resume_memory_occupation(request: Request) -> dict[str, Any]:
        tags = parse_tags(parse_body(MemoryRequest, await read_json(request)).tags)
        async with update_lock:
            done = await engine.run(lambda: engine.memory.resume(tags))
        return {"success": True, "message": f"resumed {', '.join(tags)}", **done}

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request) -> dict[str, Any]:
        req = parse_body(DestroyGroupRequest, await read_json(request))
        await asyncio.to_thread(updater.destroy_group, req)
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> dict[str, Any]:
        body = await read_json(request)
        version = body.get("new_version")
        if not isinstance(version, str) or not version:
            raise InvalidRequest("new_version must be a non-empty string")
        if body.get("abort_all_requests", True):  # SGLang 0.5.23's default
            await engine.run(lambda: engine.abort(None, "aborted for a weight version update"))
        await engine.run(lambda: engine.set_weight_version(version))
        return {"success": True, "message": f"weight version is {version}", "new_version": version}

    @app.post("/update_weights_from_disk")
    async def refused(request: Request) -> JSONResponse:
        msg = f"{request.url.path} is not supported by the built-in engine"
        return error_response(request.url.path, msg)


async def _load_when_idle(engine: Engine, copy: WeightCopy, flush: bool,
                          version: str | None) -> None:
    """Load as soon as no request runs (unless generation is paused), as SGLang's update
    waits: one round trip to the engine loop when it is idle."""

    def load_if_idle() -> bool:
        if engine.paused_mode is None and engine.num_running():
            return False
        engine.load_weights(copy, flush, version)
        return True

    engine.block_admission = engine.paused_mode is None
    try:
        while not await engine.run(load_if_idle):
            await asyncio.sleep(0.01)
    finally:
        engine.block_admission = False


async def _drain_unless_paused(engine: Engine) -> None:
    """SGLang's update waits for in-flight requests unless generation is paused."""
    if engine.paused_mode is not None:
        return
    engine.block_admission = True
    while await engine.run(engine.num_running):
        await asyncio.sleep(0.01)
