"""Decoding and checking every gRPC request before a handler sees it.

The shared handler guard (grpc_server.guarded) installs these: a request that is not a valid
protobuf of its method's type, or that carries a NaN or infinite number, is answered with
INVALID_ARGUMENT instead of reaching the servicer (grpc's own decoder would say INTERNAL).
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError, Message

from services.common.errors import InvalidRequest

_FLOATS = (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE)


def decode(deserializer: Callable[[bytes], Any] | None, raw: bytes) -> Any:
    """The request message of `raw` bytes, or InvalidRequest when they do not parse."""
    if deserializer is None:
        return raw
    try:
        message = deserializer(raw)
    except (DecodeError, ValueError, TypeError, RuntimeError) as exc:
        raise InvalidRequest(f"request is not a valid message: {type(exc).__name__}") from None
    if isinstance(message, Message):
        check_finite(message)
    return message


async def decode_stream(deserializer: Callable[[bytes], Any] | None,
                        raw_iterator: AsyncIterator[bytes]) -> AsyncIterator[Any]:
    """Decode each message of a request stream as it arrives."""
    async for raw in raw_iterator:
        yield decode(deserializer, raw)


def require(condition: bool, message: str) -> None:
    """Raise InvalidRequest with `message` unless `condition` holds (a request field check)."""
    if not condition:
        raise InvalidRequest(message)


def check_finite(message: Message, path: str = "") -> None:
    """Raise InvalidRequest naming the first float or double field that is NaN or infinite."""
    for field, value in message.ListFields():
        name = f"{path}{field.name}"
        if field.type in _FLOATS:
            values = value if field.is_repeated else (value,)
            if not all(math.isfinite(v) for v in values):
                raise InvalidRequest(f"{name}: must be a finite number")
        elif field.type == FieldDescriptor.TYPE_MESSAGE and not field.message_type.GetOptions(
        ).map_entry:
            for item in value if field.is_repeated else (value,):
                check_finite(item, f"{name}.")
