"""A failed call as an exception of its kind, with what the server said about it.

A jlora server ends a failed call with a status code and the standard rich details
(`jlora.contract.status`): a `google.rpc.BadRequest` naming the request field at fault,
a `google.rpc.ErrorInfo` with a machine-readable reason (`ADAPTER_NOT_FOUND`,
`QUEUE_FULL`, `INVALID_API_KEY`, `DRAINING`, ...), and where a server sends one a
`google.rpc.RetryInfo`. The status code picks the class (`NotFound`, `InvalidArgument`,
...; `JloraError` itself for the rest); the details fill in `field`, `reason` and
`retry_delay`. Errors grpc raises on the client's side (a deadline that passed, a server
that cannot be reached) are the same classes, without a field.

    try:
        client.generate("Hi", adapter="sql-lora")
    except NotFound as err:
        assert err.reason == "ADAPTER_NOT_FOUND" and err.field == "adapter"
"""

from __future__ import annotations

import grpc
from google.rpc import error_details_pb2, status_pb2

from jlora.contract.errors import QUEUE_FULL
from jlora.contract.status import DETAILS_KEY, from_rpc_error


class JloraError(Exception):
    """A call the server (or grpc, on the client's side) ended with an error.

    code: the gRPC status code. message: the server's, naming the field and the value.
    field: the request field at fault ("sampling.temperature", "adapter", "name"), or
    None. reason: ErrorInfo's reason, UPPER_SNAKE (the code's name when none was sent).
    retry_delay: seconds the server asks the caller to wait before sending it again
    (google.rpc.RetryInfo), or None.
    """

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN  # the subclass's

    def __init__(
        self,
        message: str,
        *,
        code: grpc.StatusCode | None = None,
        field: str | None = None,
        reason: str | None = None,
        retry_delay: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.field = field
        self.reason = reason or self.code.name
        self.retry_delay = retry_delay

    def __repr__(self) -> str:
        field = f", field={self.field!r}" if self.field else ""
        return f"{type(self).__name__}({self.reason}{field}: {self.message!r})"


class InvalidArgument(JloraError):
    """Bad input: `field` and the message name what is wrong."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(JloraError):
    """An adapter that is not registered (reason ADAPTER_NOT_FOUND), a request that is
    not in flight (Migrate), a health service the server does not know."""

    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(JloraError):
    """An adapter name taken already, a request_id in flight already."""

    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(JloraError):
    """Valid, but not now: an adapter still in use, no device slot to pin it in, a
    server that serves the base model only."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(JloraError):
    """The server's queue is full (`queue_full`: send it again once a request has ended,
    there or elsewhere), or a message past the 64 MiB limit."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    @property
    def queue_full(self) -> bool:
        return self.reason == QUEUE_FULL


class Unavailable(JloraError):
    """Worth sending again elsewhere or later: the server is draining (reason DRAINING),
    cannot be reached, or lost the worker of a stream (WORKER_LOST)."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(JloraError):
    """The call's timeout passed; the server aborted the request and freed its memory."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(JloraError):
    code = grpc.StatusCode.CANCELLED


class Aborted(JloraError):
    """A Generate stream a Migrate call took away (reason MIGRATED): its caller resumes it."""

    code = grpc.StatusCode.ABORTED


class DataLoss(JloraError):
    """An adapter file whose sha256 is not the one given (reason CHECKSUM_MISMATCH)."""

    code = grpc.StatusCode.DATA_LOSS


class Unauthenticated(JloraError):
    """A server with an API key, called without it or with another (INVALID_API_KEY)."""

    code = grpc.StatusCode.UNAUTHENTICATED


_BY_CODE: dict[grpc.StatusCode, type[JloraError]] = {
    kind.code: kind
    for kind in (
        InvalidArgument,
        NotFound,
        AlreadyExists,
        FailedPrecondition,
        ResourceExhausted,
        Unavailable,
        DeadlineExceeded,
        Cancelled,
        Aborted,
        DataLoss,
        Unauthenticated,
    )
}


def error_from_rpc(err: grpc.RpcError) -> JloraError:
    """The JloraError of a failed call (blocking or grpc.aio): its class by status code,
    with the field, reason and retry delay of the rich details where the server sent
    them."""
    code: grpc.StatusCode = err.code()  # type: ignore[attr-defined]
    sent = from_rpc_error(err)  # the contract's reading of the message, field and reason
    kind = _BY_CODE.get(code, JloraError)
    return kind(
        sent.message, code=code, field=sent.field, reason=sent.reason, retry_delay=_retry_delay(err)
    )


def _retry_delay(err: grpc.RpcError) -> float | None:
    """The seconds of the google.rpc.RetryInfo among the call's rich details, if any."""
    for key, value in err.trailing_metadata() or ():  # type: ignore[attr-defined]
        if key != DETAILS_KEY:
            continue
        for detail in status_pb2.Status.FromString(value).details:
            info = error_details_pb2.RetryInfo()
            if detail.Unpack(info):
                return info.retry_delay.ToTimedelta().total_seconds()
    return None
