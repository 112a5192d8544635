"""SGLang 0.5.23's error shapes, in one place for every route of the built-in engine.

`/generate` and the control routes answer `{"error": {"message": ...}}` (HTTP 400, or the
error's own 5xx); the weight routes answer `{"success": false, "message": ...}` with 400; an
error inside an SSE stream is one `data: {"error": {"message", "type", "code", "retryable"}}`
chunk before `data: [DONE]`.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse

# Routes whose errors take the `{"success": false, "message"}` shape.
WEIGHT_ROUTES = (
    "/init_weights_update_group",
    "/update_weights_from_distributed",
    "/update_weights_from_tensor",
    "/update_weights_from_disk",
    "/destroy_weights_update_group",
)


def error_status(http_status: int) -> int:
    """SGLang answers every client-side problem with 400."""
    return 400 if http_status < 500 else http_status


def error_response(path: str, message: str, status: int = 400) -> JSONResponse:
    """The error shape of `path`."""
    body: dict[str, Any]
    if path in WEIGHT_ROUTES:
        body = {"success": False, "message": message}
    else:
        body = {"error": {"message": message}}
    return JSONResponse(body, status_code=status)


def stream_error(message: str, status: int) -> str:
    """One SSE chunk carrying an error that happened after the stream started."""
    kind = "BadRequestError" if status < 500 else "InternalServerError"
    err = {"message": message, "type": kind, "code": status, "retryable": status >= 500}
    return f"data: {json.dumps({'error': err})}\n\n"
