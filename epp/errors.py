"""Errors that end a request with an HTTP status, as the reference EPP maps them.

The reference turns an internal code into an ImmediateResponse with the body
``inference error: <Code> - <msg>``. Every layer raises `EppError`; only the
extproc layer turns it into protocol messages.
"""

from __future__ import annotations

from enum import Enum


class Code(str, Enum):
    BAD_REQUEST = "BadRequest"
    UNAUTHORIZED = "Unauthorized"
    FORBIDDEN = "Forbidden"
    NOT_FOUND = "NotFound"
    PAYLOAD_TOO_LARGE = "PayloadTooLarge"  # ours: the reference has no code for oversized bodies
    RESOURCE_EXHAUSTED = "ResourceExhausted"
    INTERNAL = "Internal"
    SERVICE_UNAVAILABLE = "ServiceUnavailable"
    MODEL_SERVER_ERROR = "ModelServerError"


HTTP_STATUS: dict[Code, int] = {
    Code.BAD_REQUEST: 400,
    Code.UNAUTHORIZED: 401,
    Code.FORBIDDEN: 403,
    Code.NOT_FOUND: 404,
    Code.PAYLOAD_TOO_LARGE: 413,
    Code.RESOURCE_EXHAUSTED: 429,
    Code.INTERNAL: 500,
    Code.SERVICE_UNAVAILABLE: 503,
    Code.MODEL_SERVER_ERROR: 502,
}


class EppError(Exception):
    """A request-ending error with a reference error code.

    `reason` is a short machine-readable tag (e.g. ``saturated``, ``no_candidates``)
    for metrics and the decision trace; the message is for the client.
    """

    def __init__(self, code: Code, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason or code.value

    @property
    def http_status(self) -> int:
        return HTTP_STATUS.get(self.code, 500)

    def body(self) -> bytes:
        return f"inference error: {self.code.value} - {self.message}".encode()
