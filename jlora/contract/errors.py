"""One error contract for a request, or an adapter call, that cannot be done as asked.

A `RequestError` carries a status code (`Code`, named as gRPC names them), the field
at fault (a path into the jlora.v1 request message: "sampling.max_tokens", "adapter",
"prompt.chat.messages[0].role", "path"; None when no field is), a message that names
the field and the value, and a machine-readable `reason` (ErrorInfo's, UPPER_SNAKE).
It is raised where the fault is found, by the engine, the adapter code, the registry,
the servers, and travels unchanged: as a gRPC status with rich details
(`jlora.contract.status`), through the router, to the HTTP API, which maps it once to
an HTTP status and OpenAI's `param` (router/http.py).

The subclasses only fix the code, so a raise site reads as what went wrong:
`raise NotFound(f"adapter={name!r} is not registered", field="adapter")`.
"""

from __future__ import annotations

import enum


class Code(enum.Enum):
    """gRPC status codes, by name (grpc.StatusCode[code.name] is the wire's)."""

    CANCELLED = "CANCELLED"
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    ABORTED = "ABORTED"
    OUT_OF_RANGE = "OUT_OF_RANGE"
    UNIMPLEMENTED = "UNIMPLEMENTED"
    INTERNAL = "INTERNAL"
    UNAVAILABLE = "UNAVAILABLE"
    DATA_LOSS = "DATA_LOSS"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    UNKNOWN = "UNKNOWN"


# The ErrorInfo reason of a worker's Generate call that ended (ABORTED) because Migrate
# took its request to resume elsewhere: the worker sends it, the router resumes on it.
MIGRATED_REASON = "MIGRATED"
# The ErrorInfo reason of a server whose queue is full (RESOURCE_EXHAUSTED): worth sending
# again once a request ends, there or elsewhere. The router places such a request on
# another worker; any other RESOURCE_EXHAUSTED is the request's own.
QUEUE_FULL = "QUEUE_FULL"


class RequestError(Exception):
    """A request that fails as a whole; see the module docstring.

    code: the status (the subclass's, unless given). field: the request field at
    fault, or None. reason: ErrorInfo.reason (default: the code's name).
    """

    code: Code = Code.INTERNAL  # the subclass's; an instance may be given its own

    def __init__(
        self,
        message: str,
        *,
        field: str | None = None,
        code: Code | None = None,
        reason: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        if code is not None:
            self.code = code
        self.reason = reason or self.code.name

    def __repr__(self) -> str:
        field = f", field={self.field!r}" if self.field else ""
        return f"{type(self).__name__}({self.code.name}{field}: {self.message!r})"


class InvalidRequest(RequestError):
    """Bad input: the message and `field` name what is wrong."""

    code = Code.INVALID_ARGUMENT


class NotFound(RequestError):
    code = Code.NOT_FOUND


class AlreadyExists(RequestError):
    code = Code.ALREADY_EXISTS


class FailedPrecondition(RequestError):
    """Valid, but not now (an adapter still in use, no device slot to pin it in)."""

    code = Code.FAILED_PRECONDITION


class ResourceExhausted(RequestError):
    code = Code.RESOURCE_EXHAUSTED


class Unavailable(RequestError):
    """Worth retrying elsewhere or later: draining, no worker up, a worker gone."""

    code = Code.UNAVAILABLE


class DataLoss(RequestError):
    """Bytes are not what they should be (an adapter file's sha256)."""

    code = Code.DATA_LOSS


class Unauthenticated(RequestError):
    code = Code.UNAUTHENTICATED
