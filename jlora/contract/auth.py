"""The optional API key on every front door: the router's HTTP and gRPC, and workers.

`--api-key KEY` (or the `JLORA_API_KEY` environment variable) makes a server refuse
calls that do not send `authorization: Bearer KEY` (HTTP header or gRPC metadata, the
`openai` client's way) with 401 / UNAUTHENTICATED. Health checks (and gRPC reflection)
stay open, so load balancers and probes need no key. The router sends the same key to
its workers.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable, Collection

import grpc

from jlora.contract.errors import Unauthenticated
from jlora.contract.status import abort

API_KEY_ENV = "JLORA_API_KEY"


def resolve_api_key(given: str | None) -> str | None:
    """The key a server requires: `given`, else $JLORA_API_KEY; None (no key) if empty."""
    key = given if given is not None else os.environ.get(API_KEY_ENV)
    return key or None


def authorized(header: str | None, key: str | None) -> bool:
    """Whether an `authorization` header value carries `key` (any value if no key)."""
    if key is None:
        return True
    scheme, _, token = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


def call_metadata(key: str | None) -> tuple[tuple[str, str], ...]:
    """gRPC metadata a client sends to a server that requires `key`."""
    return (("authorization", f"Bearer {key}"),) if key else ()


def missing_key() -> Unauthenticated:
    return Unauthenticated(
        "a valid API key is required: send 'Authorization: Bearer <key>'",
        reason="INVALID_API_KEY",
    )


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without the key, except to `open_services` (full names)."""

    def __init__(self, key: str, open_services: Collection[str]) -> None:
        self._key = key
        self._open = frozenset(open_services)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        service = details.method.split("/")[1] if details.method.count("/") == 2 else ""
        header = dict(details.invocation_metadata or ()).get("authorization")
        if handler is None or service in self._open or authorized(header, self._key):
            return handler

        async def deny(request: object, context: grpc.aio.ServicerContext) -> None:
            await abort(context, missing_key())

        kinds = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }
        make = kinds[(handler.request_streaming, handler.response_streaming)]
        return make(
            deny,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


class _WithKey:
    def __init__(self, key: str) -> None:
        self._metadata = call_metadata(key)

    def _with_key(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), *self._metadata)
        return details._replace(metadata=metadata)  # type: ignore[attr-defined]


class _UnaryKey(_WithKey, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return await continuation(self._with_key(details), request)


class _StreamKey(_WithKey, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return await continuation(self._with_key(details), request)


def key_interceptors(key: str) -> list[grpc.aio.ClientInterceptor]:
    """A client channel's interceptors that send the key with every call (the router's
    channels to its workers). grpc.aio files an interceptor under one kind of call only,
    so there is one per kind the jlora.v1 service and health checks use."""
    return [_UnaryKey(key), _StreamKey(key)]
