"""How every jlora gRPC server is built: the worker's (jlora.server) and the router's.

`start_server` serves the `jlora.v1.Jlora` service, the standard health service and
server reflection on one port, with these guarantees:

- **One process owns its port.** gRPC sets SO_REUSEPORT on its listeners by default, so
  a second server on a taken port binds without an error and the kernel splits new
  connections between the two. Here it is off: a taken port is an OSError that says so
  ("port 50050 is already in use"), which the CLI prints with exit status 2.
- **A request that does not parse is the caller's error.** protobuf refuses a string
  field holding invalid UTF-8 while deserializing, before any handler runs, and grpc
  would answer UNKNOWN and log a traceback. `MalformedRequests` answers INVALID_ARGUMENT
  naming the field (`prompt.chat.messages[0].content`), on every service, streams of
  requests included.
- **Reflection answers under both names clients ask for**: grpc.reflection.v1alpha
  (what grpcio-reflection ships) and grpc.reflection.v1 (current grpcurl). v1 is the
  same messages in a new package, so the v1alpha servicer serves both; the v1 file
  descriptor is derived from v1alpha's, so v1 can describe itself too.
- With an API key, every call but health and reflection must carry it (auth.py).
"""

from __future__ import annotations

import contextlib
import errno
import inspect
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, empty_pb2, unknown_fields
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from jlora.api import SERVICE_NAME, jlora_pb2_grpc
from jlora.contract.auth import ApiKeyInterceptor
from jlora.contract.errors import InvalidRequest
from jlora.contract.status import abort

log = logging.getLogger(__name__)

REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
# Health and reflection need no API key; their service names.
OPEN_SERVICES = (health.SERVICE_NAME, reflection.SERVICE_NAME, REFLECTION_V1)
# The largest message a jlora server or client sends or receives: above the router's
# largest HTTP body (`HttpLimits.MAX_BODY_MB`), so a request the HTTP API takes always
# reaches a worker, which refuses an over-long prompt naming it (gRPC's default, 4 MiB,
# answered such a prompt RESOURCE_EXHAUSTED before any handler ran).
MAX_MESSAGE_BYTES = 64 << 20
MESSAGE_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
)
# grpc.aio.server options: a second server on this port must fail to bind, not share it.
# Streams on one connection are not capped: a cap makes the server refuse the streams a
# client opens before it has read the server's settings (RST_STREAM, REFUSED_STREAM).
# How much work waits is the servers' queues' business (RESOURCE_EXHAUSTED past them).
SERVER_OPTIONS = (("grpc.so_reuseport", 0), *MESSAGE_OPTIONS)


async def start_server(
    servicer: jlora_pb2_grpc.JloraServicer,
    health_servicer: health.aio.HealthServicer,
    *,
    host: str,
    port: int,
    api_key: str | None,
) -> tuple[grpc.aio.Server, int]:
    """A started grpc.aio server on host:port (port 0: a free one) with `servicer`,
    `health_servicer` and reflection, and the port it listens on. OSError naming the
    address and the reason if it cannot listen (a port in use, an unknown host)."""
    interceptors: list[grpc.aio.ServerInterceptor] = []
    if api_key is not None:  # first: a caller without the key learns only that
        interceptors.append(ApiKeyInterceptor(api_key, OPEN_SERVICES))
    interceptors.append(MalformedRequests())
    server = grpc.aio.server(interceptors=interceptors, options=SERVER_OPTIONS)
    jlora_pb2_grpc.add_JloraServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    enable_reflection(server, [SERVICE_NAME, *OPEN_SERVICES])
    bound = listen(server, host, port)
    await server.start()
    return server, bound


def listen(server: grpc.aio.Server, host: str, port: int) -> int:
    """Bind `server` to host:port and return the port; OSError saying why it cannot."""
    address = f"{host}:{port}"
    try:
        return server.add_insecure_port(address)
    except RuntimeError:  # grpc says only "Failed to bind"; find out why
        why = bind_failure(host, port) or "grpc could not bind it (GRPC_VERBOSITY=debug says why)"
        raise OSError(f"cannot listen on {address}: {why}") from None


def bind_failure(host: str, port: int) -> str:
    """Why a TCP listener on host:port cannot be opened, found by trying it as grpc does
    (SO_REUSEADDR: a port left in TIME_WAIT is free); "" if it can be now."""
    try:
        addresses = socket.getaddrinfo(
            host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as err:
        return f"cannot resolve the host {host!r} ({err.strerror})"
    for family, kind, proto, _, sockaddr in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(sockaddr)
            except OSError as err:
                if err.errno == errno.EADDRINUSE:
                    return (
                        f"port {port} is already in use (another jlora router or worker, or "
                        "another program, listens on it): stop it or choose another port"
                    )
                return f"{sockaddr[0]}: {err.strerror}"
    return ""


# -- reflection ---------------------------------------------------------------------------


def enable_reflection(server: grpc.aio.Server, service_names: list[str]) -> None:
    """Server reflection as grpc.reflection.v1alpha and grpc.reflection.v1, listing
    `service_names` (which should name both)."""
    servicer = reflection.aio.ReflectionServicer(service_names)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    _add_v1_reflection_file()
    method = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    handler = grpc.method_handlers_generic_handler(REFLECTION_V1, {"ServerReflectionInfo": method})
    server.add_generic_rpc_handlers((handler,))


def _add_v1_reflection_file() -> None:
    """Put grpc/reflection/v1/reflection.proto in the default descriptor pool (once):
    v1alpha's file under v1's name and package, as grpc's own v1 file is."""
    pool = descriptor_pool.Default()
    name = "grpc/reflection/v1/reflection.proto"
    try:
        pool.FindFileByName(name)
        return
    except KeyError:
        pass
    old, new = "grpc.reflection.v1alpha", "grpc.reflection.v1"
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    proto.name, proto.package = name, new
    proto.ClearField("options")
    for message in proto.message_type:
        for field in message.field:
            if field.HasField("type_name"):  # a message field
                field.type_name = field.type_name.replace(f".{old}.", f".{new}.")
    for service in proto.service:
        for rpc in service.method:
            rpc.input_type = rpc.input_type.replace(f".{old}.", f".{new}.")
            rpc.output_type = rpc.output_type.replace(f".{old}.", f".{new}.")
    pool.AddSerializedFile(proto.SerializeToString())


# -- malformed requests -------------------------------------------------------------------

_LENGTH_DELIMITED = 2  # the wire type of strings, bytes and messages


class _Malformed:
    """Stands in for a request message that did not parse, until the handler refuses it."""

    def __init__(self, error: InvalidRequest) -> None:
        self.error = error


class MalformedRequests(grpc.aio.ServerInterceptor):
    """Answers a request message that does not parse (invalid UTF-8 in a string field,
    truncated bytes) with INVALID_ARGUMENT naming the field, before the handler runs.

    grpc deserializes a request outside any handler, so a DecodeError there would be
    UNKNOWN and a logged traceback. The handler returned here deserializes into a
    `_Malformed` placeholder instead, and its behaviour (or its request stream) ends
    the call with the error when it meets one. Synchronous handlers are left as they are
    (a grpc.aio server of jlora has none). Each method's guarded handler is built once.
    """

    def __init__(self) -> None:
        # method -> (the server's handler, the guarded one)
        self._guarded: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        known = self._guarded.get(details.method)
        if known is None or known[0] is not handler:
            known = (handler, _guarded(handler))
            self._guarded[details.method] = known
        return known[1]


def _guarded(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """`handler` deserializing into `_Malformed` and refusing it (itself if synchronous)."""
    streaming = (handler.request_streaming, handler.response_streaming)
    make, behavior = {
        (False, False): (grpc.unary_unary_rpc_method_handler, handler.unary_unary),
        (False, True): (grpc.unary_stream_rpc_method_handler, handler.unary_stream),
        (True, False): (grpc.stream_unary_rpc_method_handler, handler.stream_unary),
        (True, True): (grpc.stream_stream_rpc_method_handler, handler.stream_stream),
    }[streaming]
    guarded = _refusing_malformed(behavior, request_streaming=handler.request_streaming)
    if guarded is None:
        return handler
    return make(
        guarded,
        request_deserializer=_tolerant(handler.request_deserializer),
        response_serializer=handler.response_serializer,
    )


def _tolerant(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """`parse`, giving a `_Malformed` where it raises DecodeError."""
    descriptor = getattr(getattr(parse, "__self__", None), "DESCRIPTOR", None)

    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as err:
            error = malformed_request(descriptor, data, err)
            log.info("refused a malformed request: %s", error.message)
            return _Malformed(error)

    return deserialize


def _refusing_malformed(
    behavior: Callable[..., Any], *, request_streaming: bool
) -> Callable[..., Any] | None:
    """`behavior`, of the same kind (coroutine or async generator), ending the call with
    the error of a `_Malformed` request; None for a synchronous one."""

    async def checked(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if request_streaming:
            return _checked_stream(request, context)
        if isinstance(request, _Malformed):
            await abort(context, request.error)
        return request

    if inspect.isasyncgenfunction(behavior):

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            responses = behavior(await checked(request, context), context)
            async with contextlib.aclosing(responses):  # its `finally` runs when this ends
                async for response in responses:
                    yield response

        return stream
    if inspect.iscoroutinefunction(behavior):

        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            return await behavior(await checked(request, context), context)

        return call
    return None


async def _checked_stream(
    requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, _Malformed):
            await abort(context, request.error)
        yield request


def malformed_request(
    descriptor: Descriptor | None, data: bytes, err: DecodeError
) -> InvalidRequest:
    """The InvalidRequest for `data`, which protobuf could not parse as a `descriptor`
    message (`err`): naming the string field that is not UTF-8 if one is."""
    kind = descriptor.full_name if descriptor is not None else "request message"
    field = _non_utf8_field(descriptor, data) if descriptor is not None else None
    if field is not None:
        return InvalidRequest(
            f"{field} holds invalid UTF-8: the string fields of a {kind} must be valid UTF-8",
            field=field,
            reason="INVALID_UTF8",
        )
    _, colon, cause = str(err).rpartition("': ")
    if not colon:
        cause = "its bytes are not that message in protobuf's encoding"
    return InvalidRequest(f"the request is not a valid {kind} ({cause})", reason="MALFORMED")


def _non_utf8_field(descriptor: Descriptor, data: bytes) -> str | None:
    """The path ("prompt.chat.messages[0].content") of the first string field of `data`,
    a serialized `descriptor` message, that is not UTF-8; None if there is none or the
    bytes are not protobuf at all. Read as unknown fields of an empty message, which
    protobuf does not check."""
    try:
        fields = unknown_fields.UnknownFieldSet(empty_pb2.Empty.FromString(data))
    except DecodeError:
        return None
    counts: dict[int, int] = {}
    for unknown in fields:
        index = counts.get(unknown.field_number, 0)
        counts[unknown.field_number] = index + 1
        field = descriptor.fields_by_number.get(unknown.field_number)
        if field is None or unknown.wire_type != _LENGTH_DELIMITED:
            continue
        path = _field_path(field, index)
        if field.type == FieldDescriptor.TYPE_STRING:
            try:
                unknown.data.decode("utf-8")
            except UnicodeDecodeError:
                return path
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            inner = _non_utf8_field(field.message_type, unknown.data)
            if inner is not None:
                return f"{path}.{inner}"
    return None


def _field_path(field: FieldDescriptor, index: int) -> str:
    """A field as errors name it: a oneof member under its oneof ("prompt.text"), an
    element of a repeated field by its index ("stop[1]")."""
    name = field.name
    oneof = field.containing_oneof
    if oneof is not None and oneof.name != f"_{field.name}":  # not a proto3 `optional`
        name = f"{oneof.name}.{name}"
    return f"{name}[{index}]" if field.is_repeated else name
