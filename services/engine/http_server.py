"""The SGLang-compatible HTTP API of the built-in engine (FastAPI): generation and the
scheduler's control routes here, read-only facts in info_routes.py, weight routes in
weight_routes.py, error shapes in sglang_errors.py.

Generation requests are handed to the engine loop and awaited; control endpoints run their
work on the loop thread between steps.
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
from services.engine.api_key import ApiKeyGuard
from services.engine.engine import PAUSE_MODES, Engine
from services.engine.generate_io import build_response, parse_generate
from services.engine.info_routes import add_info_routes, read_json
from services.engine.request import GenRequest, SamplingParams, Update
from services.engine.sglang_errors import error_response, error_status, stream_error
from services.engine.weight_routes import add_weight_routes
from services.engine.weight_update import WeightUpdater

log = logging.getLogger(__name__)


def create_app(engine: Engine) -> FastAPI:
    """The FastAPI app serving `engine` (behind its API key when one is set)."""
    app = FastAPI(title="riptide built-in engine")
    if engine.config.api_key:
        app.add_middleware(ApiKeyGuard, api_key=engine.config.api_key)
    updater = WeightUpdater(engine.runner, engine.config.weight_update_timeout_s)
    app.state.engine, app.state.updater = engine, updater
    in_flight: set[str] = set()  # rids of requests running now (SGLang refuses a second one)

    @app.exception_handler(RiptideError)
    async def _riptide_error(request: Request, exc: RiptideError) -> JSONResponse:
        return error_response(request.url.path, str(exc), error_status(exc.http_status))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(request.url.path, str(exc))

    async def run_request(req: GenRequest, request: Request | None) -> AsyncIterator[Update]:
        """Submit `req` and yield its updates until it finishes; aborts it if the client left."""
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue[Update] = asyncio.Queue()

        def emit(update: Update) -> None:
            loop.call_soon_threadsafe(updates.put_nowait, update)

        req.emit = emit
        finished = False
        await engine.run(lambda: engine.submit(req))
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
            in_flight.discard(req.rid)
            if not finished:
                engine.call(lambda: engine.abort_where(lambda r: r is req, "client disconnected"))

    def admit(reqs: list[GenRequest]) -> None:
        """Claim the rids of `reqs`; a rid still in flight is a 400, as in SGLang."""
        taken = [r.rid for r in reqs if r.rid in in_flight]
        if taken:
            raise InvalidRequest(f"Duplicate request ID: {taken[0]} is still in flight")
        in_flight.update(r.rid for r in reqs)

    async def generate_one(req: GenRequest, request: Request, text_lp: bool) -> dict[str, Any]:
        last = None
        async for update in run_request(req, request):
            last = update
        if last is None or not last.finished:
            return {"error": {"message": "client disconnected"}}
        return build_response(req, last, engine.runner, text_lp)

    @app.post("/generate")
    async def generate(request: Request) -> Any:
        body = await read_json(request)
        if isinstance(body, dict) and body.get("stream"):
            # As SGLang: once streaming is asked for, even a refused request answers 200 and
            # carries its error in the stream.
            return StreamingResponse(stream(body, request), media_type="text/event-stream")
        reqs, batched = parse_generate(body, engine.runner, engine.config.dp_size)
        admit(reqs)
        text_lp = bool(body.get("return_text_in_logprobs"))
        results = await asyncio.gather(*(generate_one(r, request, text_lp) for r in reqs))
        return results if batched else results[0]

    async def stream(body: dict[str, Any], request: Request) -> AsyncIterator[str]:
        text_lp = bool(body.get("return_text_in_logprobs"))
        try:
            reqs, _ = parse_generate(body, engine.runner, engine.config.dp_size)
            admit(reqs)
            async for update in run_request(reqs[0], request):
                chunk = build_response(reqs[0], update, engine.runner, text_lp)
                yield f"data: {json.dumps(chunk)}\n\n"
        except RiptideError as exc:
            yield stream_error(str(exc), error_status(exc.http_status))
        except Exception as exc:  # the status line is sent: errors travel in-stream
            log.exception("stream failed")
            yield stream_error(f"{type(exc).__name__}: {exc}", 500)
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

    add_info_routes(app, engine)
    add_weight_routes(app, engine, updater)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        if not await engine.run(engine.flush_cache):
            msg = "Cache not flushed: there are running or waiting requests."
            return error_response("/flush_cache", msg)
        return Response("Cache flushed.\n", status_code=200)

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await read_json(request)
        rids = None if body.get("abort_all") else {str(body.get("rid", ""))}
        count = await engine.run(lambda: engine.abort(rids, "aborted by /abort_request"))
        log.info("aborted %d request(s)", count)
        return Response(status_code=200)  # SGLang answers an empty 200

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> dict[str, Any]:
        mode = (await read_json(request)).get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise InvalidRequest(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        await engine.run(lambda: engine.pause(mode))
        return {"status": "ok", "message": f"Generation paused ({mode})."}

    @app.post("/continue_generation")
    async def continue_generation() -> dict[str, Any]:
        await engine.run(engine.resume)
        return {"status": "ok", "message": "Generation continued."}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type="text/plain; version=0.0.4")

    return app
