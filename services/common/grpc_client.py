"""gRPC channels to Riptide peers: large messages and the shared token on every call."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc

from services.common.config import GrpcTlsConfig
from services.common.errors import ConfigError
from services.common.grpc_server import TOKEN_METADATA_KEY

_MB = 1024 * 1024


class _WithMetadata:
    """A multicallable that adds `pair` to each call's metadata."""

    def __init__(self, call: Any, pair: tuple[str, str]) -> None:
        self._call, self._pair = call, pair

    def __call__(self, *args: Any, metadata: Any = None, **kwargs: Any) -> Any:
        return self._call(*args, metadata=(*(metadata or ()), self._pair), **kwargs)


class _TokenChannel(grpc.aio.Channel):
    """An asyncio channel whose every call carries the bearer token, as call metadata: a
    grpc.aio client interceptor would wrap each call in an intercepted call and a task."""

    def __init__(self, channel: grpc.aio.Channel, token: str) -> None:
        self._channel, self._pair = channel, (TOKEN_METADATA_KEY, f"Bearer {token}")

    def unary_unary(self, *args: Any, **kwargs: Any) -> Any:
        return _WithMetadata(self._channel.unary_unary(*args, **kwargs), self._pair)

    def unary_stream(self, *args: Any, **kwargs: Any) -> Any:
        return _WithMetadata(self._channel.unary_stream(*args, **kwargs), self._pair)

    def stream_unary(self, *args: Any, **kwargs: Any) -> Any:
        return _WithMetadata(self._channel.stream_unary(*args, **kwargs), self._pair)

    def stream_stream(self, *args: Any, **kwargs: Any) -> Any:
        return _WithMetadata(self._channel.stream_stream(*args, **kwargs), self._pair)

    async def __aenter__(self) -> _TokenChannel:
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self._channel.close(None)

    async def close(self, grace: float | None = None) -> None:
        await self._channel.close(grace)

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return self._channel.get_state(try_to_connect)

    async def wait_for_state_change(self, last_observed_state: grpc.ChannelConnectivity
                                    ) -> None:
        await self._channel.wait_for_state_change(last_observed_state)

    async def channel_ready(self) -> None:
        await self._channel.channel_ready()


#: Longest wait between two attempts to reach a peer that is away. gRPC's own backoff grows
#: to 120 s: after a peer's restart of a few minutes (an engine fleet loading a large model)
#: its callers would keep failing fast for up to two minutes more, as if it were still down.
MAX_RECONNECT_BACKOFF_MS = 2000


def _options(max_message_mb: int) -> list[tuple[str, int]]:
    size = max_message_mb * _MB
    return [("grpc.max_send_message_length", size), ("grpc.max_receive_message_length", size),
            ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS)]


def channel_credentials(tls: GrpcTlsConfig) -> grpc.ChannelCredentials:
    """TLS that trusts the deployment's CA only."""
    return grpc.ssl_channel_credentials(root_certificates=read_pem(tls.ca_file, "ca_file"))


def read_pem(path: str, key: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"run.grpc_tls.{key}: cannot read {path}: {exc.strerror}") from None


def aio_channel(address: str, token: str | None = None, max_message_mb: int = 256,
                tls: GrpcTlsConfig | None = None) -> grpc.aio.Channel:
    """An asyncio channel to `address` (host:port) that sends `token` when one is set, over
    TLS when `tls` is given."""
    if tls is None:
        channel = grpc.aio.insecure_channel(address, options=_options(max_message_mb))
    else:
        channel = grpc.aio.secure_channel(address, channel_credentials(tls),
                                          options=_options(max_message_mb))
    return _TokenChannel(channel, token) if token else channel


def sync_channel(address: str, token: str | None = None, max_message_mb: int = 256,
                 tls: GrpcTlsConfig | None = None) -> grpc.Channel:
    """A blocking channel to `address` that sends `token` when one is set, over TLS when
    `tls` is given."""
    if tls is None:
        channel = grpc.insecure_channel(address, options=_options(max_message_mb))
    else:
        channel = grpc.secure_channel(address, channel_credentials(tls),
                                      options=_options(max_message_mb))
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
