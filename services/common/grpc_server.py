"""gRPC server bootstrap: health service, error mapping and an optional shared token.

When `run.grpc_token` is set every call but grpc.health.v1 must carry it, mutating or not:
GetStatus and ListTasks reveal the run's state, Generate and RunEpisode spend its engines.
"""

from __future__ import annotations

import functools
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common.errors import RiptideError, Unavailable, quote
from services.common.grpc_requests import decode, decode_stream

log = logging.getLogger(__name__)
_HEALTH_PREFIX = "/grpc.health.v1.Health/"
TOKEN_METADATA_KEY = "authorization"
_MAX_DETAILS = 2000


async def _abort_for(exc: BaseException, context: grpc.aio.ServicerContext) -> None:
    # Details travel in a header: cut them, so bad input of any size is never echoed whole.
    if isinstance(exc, RiptideError):
        await context.abort(exc.grpc_code, quote(str(exc), _MAX_DETAILS))
    log.exception("unhandled error in gRPC handler")
    await context.abort(grpc.StatusCode.INTERNAL,
                        quote(f"{type(exc).__name__}: {exc}", _MAX_DETAILS))


def _wrap_unary(behavior: Callable[..., Awaitable[Any]], decoder: Callable[[Any], Any]
                ) -> Callable[..., Awaitable[Any]]:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await behavior(decoder(request), context)
        except (grpc.aio.AbortError, grpc.RpcError) as exc:
            raise exc
        except Exception as exc:  # noqa: BLE001 - the one place errors become statuses
            await _abort_for(exc, context)

    return wrapped


def _wrap_stream(behavior: Callable[..., AsyncIterator[Any]], decoder: Callable[[Any], Any]
                 ) -> Callable[..., AsyncIterator[Any]]:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async for item in behavior(decoder(request), context):
                yield item
        except (grpc.aio.AbortError, grpc.RpcError) as exc:
            raise exc
        except Exception as exc:  # noqa: BLE001
            await _abort_for(exc, context)

    return wrapped


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Decode and check each request (INVALID_ARGUMENT when malformed), turn RiptideError
    into its status code and anything else into INTERNAL with the cause."""

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.startswith(_HEALTH_PREFIX):
            return handler
        parse = handler.request_deserializer
        one = functools.partial(decode, parse)
        many = functools.partial(decode_stream, parse)
        # The handler gets raw bytes (no deserializer) and decodes them itself, inside the
        # wrapper, so a malformed message becomes InvalidRequest like any handler's error.
        kinds = (
            (handler.unary_unary, grpc.unary_unary_rpc_method_handler, _wrap_unary, one),
            (handler.stream_unary, grpc.stream_unary_rpc_method_handler, _wrap_unary, many),
            (handler.unary_stream, grpc.unary_stream_rpc_method_handler, _wrap_stream, one),
            (handler.stream_stream, grpc.stream_stream_rpc_method_handler, _wrap_stream, many),
        )
        behavior, make, wrap, decoder = next(k for k in kinds if k[0] is not None)
        return make(wrap(behavior, decoder), None, handler.response_serializer)


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Reject calls without `authorization: Bearer <token>` before any handler runs; health
    checks stay open."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        if details.method.startswith(_HEALTH_PREFIX):
            return await continuation(details)
        sent = dict(details.invocation_metadata or ()).get(TOKEN_METADATA_KEY, "")
        if hmac.compare_digest(str(sent).encode(), self._expected):
            return await continuation(details)
        handler = await continuation(details)  # only looked up, to answer in its own shape
        return _denial(handler)


def _denial(handler: Any) -> Any:
    """A handler of the same streaming kind as `handler` that reads nothing and refuses."""

    async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong gRPC token")

    async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await deny(request, context)
        yield None  # pragma: no cover - abort raised

    if handler is None or handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(deny)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(deny)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(deny_stream)
    return grpc.stream_stream_rpc_method_handler(deny_stream)


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Metadata a client sends so that a TokenInterceptor lets it through."""
    return ((TOKEN_METADATA_KEY, f"Bearer {token}"),) if token else ()


class GrpcServer:
    """A grpc.aio server with grpc.health.v1 and Riptide's interceptors."""

    def __init__(self, service_name: str, token: str | None = None,
                 max_message_mb: int = 256) -> None:
        interceptors: list[grpc.aio.ServerInterceptor] = [ErrorInterceptor()]
        if token:
            interceptors.insert(0, TokenInterceptor(token))
        size = max_message_mb * 1024 * 1024
        self.server = grpc.aio.server(
            interceptors=interceptors,
            options=[("grpc.max_send_message_length", size),
                     ("grpc.max_receive_message_length", size)],
        )
        self.service_name = service_name
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = 0

    async def start(self, host: str, port: int) -> int:
        try:
            self.port = self.server.add_insecure_port(f"{host}:{port}")
        except RuntimeError as exc:
            raise Unavailable(f"cannot listen for gRPC on {host}:{port}: {exc}") from None
        if self.port == 0:
            raise Unavailable(f"cannot listen for gRPC on {host}:{port}")
        await self.server.start()
        await self.set_serving(False)
        return self.port

    async def set_serving(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ("", self.service_name):
            await self.health.set(name, status)

    async def stop(self, grace_s: float) -> None:
        await self.set_serving(False)
        await self.server.stop(grace_s)
