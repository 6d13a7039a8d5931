"""A `RequestError` as a gRPC status with rich details, and back.

On the wire a failed call has its code, its message as the status details, and the
standard rich-error trailer `grpc-status-details-bin`: a `google.rpc.Status` whose
details hold a `google.rpc.BadRequest` (one field violation: the field at fault) when
a field is at fault, and a `google.rpc.ErrorInfo` (the reason, domain "jlora.v1").
Any gRPC client library reads them (`grpc_status.rpc_status` in Python); the router
reads them with `from_rpc_error` and passes the error on unchanged.
"""

from __future__ import annotations

from typing import NoReturn

import grpc
from google.rpc import error_details_pb2, status_pb2

from jlora.contract.errors import Code, RequestError

DOMAIN = "jlora.v1"
DETAILS_KEY = "grpc-status-details-bin"


def grpc_code(code: Code) -> grpc.StatusCode:
    return grpc.StatusCode[code.name]


def status_proto(err: RequestError) -> status_pb2.Status:
    """The `google.rpc.Status` of `err`, with its BadRequest and ErrorInfo details."""
    status = status_pb2.Status(code=grpc_code(err.code).value[0], message=err.message)
    if err.field:
        violation = error_details_pb2.BadRequest.FieldViolation(
            field=err.field, description=err.message
        )
        status.details.add().Pack(error_details_pb2.BadRequest(field_violations=[violation]))
    status.details.add().Pack(error_details_pb2.ErrorInfo(reason=err.reason, domain=DOMAIN))
    return status


def trailing_metadata(err: RequestError) -> tuple[tuple[str, bytes], ...]:
    return ((DETAILS_KEY, status_proto(err).SerializeToString()),)


async def abort(context: grpc.aio.ServicerContext, err: RequestError) -> NoReturn:
    """End the call with `err` (code, message, rich details)."""
    await context.abort(grpc_code(err.code), err.message, trailing_metadata(err))
    raise AssertionError("context.abort returned")


def from_rpc_error(err: grpc.RpcError) -> RequestError:
    """The RequestError a failed call carries: its code and message, with the field and
    reason from the rich details when the server sent them."""
    code = err.code()  # type: ignore[attr-defined]
    message = err.details() or code.name  # type: ignore[attr-defined]
    field, reason = None, None
    for key, value in err.trailing_metadata() or ():  # type: ignore[attr-defined]
        if key != DETAILS_KEY:
            continue
        status = status_pb2.Status.FromString(value)
        for detail in status.details:
            if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                bad = error_details_pb2.BadRequest()
                detail.Unpack(bad)
                field = next((v.field for v in bad.field_violations if v.field), field)
            elif detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                reason = info.reason or None
    known = code.name if code.name in Code.__members__ else Code.UNKNOWN.name
    return RequestError(message, field=field, code=Code[known], reason=reason)
