"""One error hierarchy for Riptide, mapped to gRPC and HTTP status codes in one place."""

from __future__ import annotations

import grpc


class RiptideError(Exception):
    """Base of every error Riptide raises on purpose; the message is shown to the caller."""

    grpc_code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    http_status: int = 500


class ConfigError(RiptideError):
    """A deployment config or a live config patch is invalid."""

    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    http_status = 400


class InvalidRequest(RiptideError):
    """A request is malformed or its values are out of range."""

    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    http_status = 400


class PayloadTooLarge(InvalidRequest):
    """A request body is larger than the service accepts."""

    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 413


class NotFound(RiptideError):
    """A named thing (task, engine, group) does not exist."""

    grpc_code = grpc.StatusCode.NOT_FOUND
    http_status = 404


class Conflict(RiptideError):
    """The request clashes with the current state (already paused, already registered...)."""

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION
    http_status = 409


class Unavailable(RiptideError):
    """A dependency (Redis, an engine, a sandbox provider) cannot be reached now; retry later."""

    grpc_code = grpc.StatusCode.UNAVAILABLE
    http_status = 503


class Backpressure(Unavailable):
    """A bounded queue is full; the producer should wait and retry."""

    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 429


class DeadlineExceeded(RiptideError):
    """An operation ran past its time limit."""

    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED
    http_status = 504


class Unauthenticated(RiptideError):
    """A missing or wrong bearer token."""

    grpc_code = grpc.StatusCode.UNAUTHENTICATED
    http_status = 401


def quote(value: object, limit: int = 64) -> str:
    """`value` for an error message: its repr, cut to `limit` characters, so bad input of
    any size is echoed as a short prefix only."""
    text = repr(value) if not isinstance(value, str) else value
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"
