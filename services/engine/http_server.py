"""The SGLang-compatible HTTP API of the built-in engine (FastAPI).

Generation requests are handed to the engine loop and awaited; control endpoints run their
work on the loop thread between steps; weight updates rendezvous and receive on worker threads
so the API stays responsive.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from services.common.errors import InvalidRequest, RiptideError
from services.engine.engine import PAUSE_MODES, Engine
from services.engine.generate_io import build_response, parse_generate
from services.engine.request import GenRequest, SamplingParams, Update
from services.engine.weight_update import (
    DestroyGroupRequest,
    InitGroupRequest,
    UpdateWeightsRequest,
    WeightUpdater,
    parse_body,
)

log = logging.getLogger(__name__)
VERSION = "riptide-engine-0.1.0"


def error_body(status: int, message: str) -> dict[str, Any]:
    kind = "BadRequestError" if status < 500 else "InternalServerError"
    return {"object": "error", "message": message, "type": kind, "code": status}


async def _json(request: Request) -> Any:
    raw = await request.body()
    if not raw:
        return {}
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"the body is not valid JSON: {exc}") from None


def create_app(engine: Engine) -> FastAPI:
    """The FastAPI app serving `engine`."""
    app = FastAPI(title="riptide built-in engine")
    updater = WeightUpdater(engine.runner, engine.config.weight_update_timeout_s)
    update_lock = asyncio.Lock()
    app.state.engine, app.state.updater = engine, updater

    @app.exception_handler(RiptideError)
    async def _riptide_error(_: Request, exc: RiptideError) -> JSONResponse:
        status = 400 if exc.http_status < 500 else exc.http_status
        return JSONResponse(error_body(status, str(exc)), status_code=status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(400, str(exc)), status_code=400)

    async def run_request(req: GenRequest, request: Request | None) -> AsyncIterator[Update]:
        """Submit `req` and yield its updates until it finishes; aborts it if the client left."""
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue[Update] = asyncio.Queue()

        def emit(update: Update) -> None:
            loop.call_soon_threadsafe(updates.put_nowait, update)

        req.emit = emit
        await engine.run(lambda: engine.submit(req))
        finished = False
        try:
            while not finished:
                try:
                    update = await asyncio.wait_for(updates.get(), timeout=1.0)
                except TimeoutError:
                    if request is not None and await request.is_disconnected():
                        return
                    continue
                finished = update.finished
                yield update
        finally:
            if not finished:
                engine.call(lambda: engine.abort_where(lambda r: r is req, "client disconnected"))

    async def generate_one(req: GenRequest, request: Request, text_lp: bool) -> dict[str, Any]:
        last = None
        async for update in run_request(req, request):
            last = update
        if last is None or not last.finished:
            return error_body(499, "client disconnected")
        return build_response(req, last, engine.runner, text_lp)

    @app.post("/generate")
    async def generate(request: Request) -> Any:
        body = await _json(request)
        reqs, batched = parse_generate(body, engine.runner, engine.config.dp_size)
        text_lp = bool(body.get("return_text_in_logprobs"))
        if body.get("stream"):
            return StreamingResponse(
                stream(reqs[0], request, text_lp), media_type="text/event-stream"
            )
        results = await asyncio.gather(*(generate_one(r, request, text_lp) for r in reqs))
        return results if batched else results[0]

    async def stream(req: GenRequest, request: Request, text_lp: bool) -> AsyncIterator[str]:
        try:
            async for update in run_request(req, request):
                chunk = build_response(req, update, engine.runner, text_lp)
                yield f"data: {json.dumps(chunk)}\n\n"
        except Exception as exc:  # the status line is sent: errors travel in-stream
            log.exception("stream of %s failed", req.rid)
            yield f"data: {json.dumps({'error': {'message': f'{type(exc).__name__}: {exc}'}})}\n\n"
        yield "data: [DONE]\n\n"

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.alive else 503)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        if not engine.alive:
            return Response(status_code=503)
        if engine.paused_mode is not None:
            return Response(status_code=200)
        probe = GenRequest(input_ids=[0], params=SamplingParams(max_new_tokens=1, temperature=0))
        try:
            async with asyncio.timeout(30):
                async for _ in run_request(probe, None):
                    pass
        except TimeoutError:
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        cfg = engine.config
        return {
            "model_path": cfg.model_path,
            "tokenizer_path": cfg.tokenizer_path or cfg.model_path,
            "is_generation": True,
            "weight_version": engine.weight_version,
            "preferred_sampling_params": None,
        }

    @app.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        cfg = engine.config
        states = await engine.run(engine.server_state)
        return {
            **cfg.model_dump(),
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
            "internal_states": states,
            "version": VERSION,
        }

    @app.get("/get_load")
    async def get_load() -> list[dict[str, Any]]:
        return await engine.run(lambda: [s.load() for s in engine.schedulers])

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        if not await engine.run(engine.flush_cache):
            msg = "Cache not flushed: there are running or waiting requests."
            return JSONResponse(error_body(400, msg), status_code=400)
        return Response("Cache flushed.\n", status_code=200)

    @app.post("/abort_request")
    async def abort_request(request: Request) -> dict[str, Any]:
        body = await _json(request)
        rids = None if body.get("abort_all") else {str(body.get("rid", ""))}
        count = await engine.run(lambda: engine.abort(rids, "aborted by /abort_request"))
        return {"success": True, "num_aborted": count}

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> dict[str, Any]:
        mode = (await _json(request)).get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise InvalidRequest(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        await engine.run(lambda: engine.pause(mode))
        return {"status": "ok", "message": f"Generation paused ({mode})."}

    @app.post("/continue_generation")
    async def continue_generation() -> dict[str, Any]:
        await engine.run(engine.resume)
        return {"status": "ok", "message": "Generation continued."}

    @app.get("/get_weight_version")
    async def get_weight_version() -> dict[str, Any]:
        return {"weight_version": engine.weight_version}

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> dict[str, Any]:
        body = await _json(request)
        version = body.get("new_version")
        if not isinstance(version, str) or not version:
            raise InvalidRequest("new_version must be a non-empty string")
        if body.get("abort_all_requests"):
            await engine.run(lambda: engine.abort(None, "aborted for a weight version update"))
        await engine.run(lambda: engine.set_weight_version(version))
        return {"success": True, "message": f"weight version is {version}", "new_version": version}

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request) -> JSONResponse:
        req = parse_body(InitGroupRequest, await _json(request))
        try:
            await asyncio.to_thread(updater.init_group, req)
        except RiptideError:
            raise
        except Exception as exc:  # rendezvous failures become a precise 400
            msg = f"Failed to init weights update group: {type(exc).__name__}: {exc}"
            return JSONResponse({"success": False, "message": msg}, status_code=400)
        msg = "Succeeded to initialize custom process group."
        return JSONResponse({"success": True, "message": msg})

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request) -> JSONResponse:
        req = parse_body(UpdateWeightsRequest, await _json(request))
        dtypes = updater.validate(req)
        async with update_lock:
            if req.abort_all_requests:
                await engine.run(lambda: engine.abort(None, "aborted for a weight update"))
            await _drain_unless_paused(engine)
            try:
                tensors = await asyncio.to_thread(updater.receive, req, dtypes)
                await engine.run(
                    lambda: engine.load_weights(tensors, req.flush_cache, req.weight_version)
                )
            except Exception as exc:  # a broken broadcast leaves the old weights in place
                msg = f"Failed to update weights: {type(exc).__name__}: {exc}"
                return JSONResponse({"success": False, "message": msg}, status_code=400)
            finally:
                engine.block_admission = False
        msg = "Succeeded to update parameter online."
        return JSONResponse({"success": True, "message": msg})

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request) -> dict[str, Any]:
        req = parse_body(DestroyGroupRequest, await _json(request))
        await asyncio.to_thread(updater.destroy_group, req)
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    @app.post("/release_memory_occupation")
    @app.post("/resume_memory_occupation")
    async def memory_occupation() -> JSONResponse:
        msg = "memory release is not supported by the built-in engine"
        return JSONResponse(error_body(400, msg), status_code=400)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type="text/plain; version=0.0.4")

    return app


async def _drain_unless_paused(engine: Engine) -> None:
    """SGLang's update waits for in-flight requests unless generation is paused."""
    if engine.paused_mode is not None:
        return
    engine.block_admission = True
    while await engine.run(engine.num_running):
        await asyncio.sleep(0.01)
