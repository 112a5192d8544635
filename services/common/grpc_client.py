"""gRPC channels to Riptide peers: large messages and the shared token on every call."""

from __future__ import annotations

from typing import Any

import grpc

from services.common.grpc_server import TOKEN_METADATA_KEY

_MB = 1024 * 1024


class _WithToken:
    """Adds the bearer token to a call's metadata."""

    def __init__(self, token: str) -> None:
        self._pair = (TOKEN_METADATA_KEY, f"Bearer {token}")

    def _with_token(self, details: Any) -> Any:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), self._pair)
        return details._replace(metadata=metadata)


# One class per call kind: grpc.aio files each interceptor under the first kind it is an
# instance of, so one class of all four kinds would reach unary-unary calls only.
class _UnaryUnaryToken(_WithToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._with_token(details), request)


class _UnaryStreamToken(_WithToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._with_token(details), request)


class _StreamUnaryToken(_WithToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, details: Any,
                                     request_iterator: Any) -> Any:
        return await continuation(self._with_token(details), request_iterator)


class _StreamStreamToken(_WithToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, details: Any,
                                      request_iterator: Any) -> Any:
        return await continuation(self._with_token(details), request_iterator)


_TOKEN_INTERCEPTORS = (_UnaryUnaryToken, _UnaryStreamToken, _StreamUnaryToken, _StreamStreamToken)


#: Longest wait between two attempts to reach a peer that is away. gRPC's own backoff grows
#: to 120 s: after a peer's restart of a few minutes (an engine fleet loading a large model)
#: its callers would keep failing fast for up to two minutes more, as if it were still down.
MAX_RECONNECT_BACKOFF_MS = 2000


def _options(max_message_mb: int) -> list[tuple[str, int]]:
    size = max_message_mb * _MB
    return [("grpc.max_send_message_length", size), ("grpc.max_receive_message_length", size),
            ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS)]


def aio_channel(address: str, token: str | None = None,
                max_message_mb: int = 256) -> grpc.aio.Channel:
    """An asyncio channel to `address` (host:port) that sends `token` when one is set."""
    interceptors = [kind(token) for kind in _TOKEN_INTERCEPTORS] if token else None
    return grpc.aio.insecure_channel(address, options=_options(max_message_mb),
                                     interceptors=interceptors)


def sync_channel(address: str, token: str | None = None,
                 max_message_mb: int = 256) -> grpc.Channel:
    """A blocking channel to `address` that sends `token` when one is set."""
    channel = grpc.insecure_channel(address, options=_options(max_message_mb))
    if token:
        from services.common.grpc_server import call_metadata

        pair = call_metadata(token)[0]
        channel = grpc.intercept_channel(channel, _SyncToken(pair))
    return channel


class _SyncToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                 grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, pair: tuple[str, str]) -> None:
        self._pair = pair

    def _details(self, details: Any) -> Any:
        return _Details(details.method, details.timeout,
                        list(details.metadata or ()) + [self._pair], details.credentials,
                        details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, request_iter: Any) -> Any:
        return continuation(self._details(details), request_iter)

    def intercept_stream_stream(self, continuation: Any, details: Any, request_iter: Any) -> Any:
        return continuation(self._details(details), request_iter)


class _Details(grpc.ClientCallDetails):
    def __init__(self, method: str, timeout: Any, metadata: Any, credentials: Any,
                 wait_for_ready: Any, compression: Any) -> None:
        self.method = method
        self.timeout = timeout
        self.metadata = metadata
        self.credentials = credentials
        self.wait_for_ready = wait_for_ready
        self.compression = compression
