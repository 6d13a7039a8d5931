"""The router's errors: a gRPC status code and a message that names the field."""

from __future__ import annotations

import grpc


class RouterError(Exception):
    """A status for the caller: a gRPC code and a message that names the field. The gRPC
    service answers with it as is; the HTTP API maps it (http.py)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def status_code(name: str) -> grpc.StatusCode:
    """The code a `grpc_status` attribute names ("NOT_FOUND"); INTERNAL if none."""
    return getattr(grpc.StatusCode, name, grpc.StatusCode.INTERNAL)
