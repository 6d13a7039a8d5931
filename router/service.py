"""The router's `jlora.v1.Jlora` gRPC service: the front door's methods as RPCs.

Each handler calls `FrontDoor` and turns a `RequestError` into the call's status, with
its rich details (`jlora.contract.status`): a worker's errors pass through unchanged. A
Generate call's deadline becomes the front door's deadline; when the caller cancels (or
the deadline passes) grpc cancels the handler, and closing the front door's stream
cancels the worker's call.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

import grpc

from jlora.api import jlora_pb2 as pb
from jlora.api import jlora_pb2_grpc as pb_grpc
from jlora.contract.errors import Code, RequestError
from jlora.contract.status import abort
from router.frontdoor import FrontDoor

T = TypeVar("T")


async def _answer(context: grpc.aio.ServicerContext, call: Awaitable[T]) -> T:
    try:
        return await call
    except RequestError as err:
        await abort(context, err)


class RouterServicer(pb_grpc.JloraServicer):
    def __init__(self, front: FrontDoor) -> None:
        self._front = front

    async def Generate(  # noqa: N802 (the proto's name)
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        left = context.time_remaining()
        deadline = asyncio.get_running_loop().time() + left if left is not None else None
        stream = self._front.generate(request, deadline=deadline)
        try:
            async with contextlib.aclosing(stream):
                async for response in stream:
                    yield response
        except RequestError as err:
            await abort(context, err)

    async def RegisterAdapter(  # noqa: N802
        self, request: pb.RegisterAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.RegisterAdapterResponse:
        adapter = await _answer(context, self._front.adapters.register(request))
        return pb.RegisterAdapterResponse(adapter=adapter)

    async def LoadAdapter(  # noqa: N802
        self, request: pb.LoadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoadAdapterResponse:
        adapter = await _answer(context, self._front.adapters.load(request.name, pin=request.pin))
        return pb.LoadAdapterResponse(adapter=adapter)

    async def UnloadAdapter(  # noqa: N802
        self, request: pb.UnloadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.UnloadAdapterResponse:
        adapter = await _answer(context, self._front.adapters.unload(request.name))
        return pb.UnloadAdapterResponse(adapter=adapter)

    async def UnregisterAdapter(  # noqa: N802
        self, request: pb.UnregisterAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.UnregisterAdapterResponse:
        await _answer(context, self._front.adapters.unregister(request.name))
        return pb.UnregisterAdapterResponse()

    async def ListAdapters(  # noqa: N802
        self, request: pb.ListAdaptersRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListAdaptersResponse:
        adapters = await _answer(context, self._front.adapters.entries())
        return pb.ListAdaptersResponse(adapters=adapters)

    async def Stats(  # noqa: N802
        self, request: pb.StatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.StatsResponse:
        return self._front.stats()

    async def Models(  # noqa: N802
        self, request: pb.ModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelsResponse:
        return pb.ModelsResponse(models=self._front.models())

    async def Migrate(  # noqa: N802
        self, request: pb.MigrateRequest, context: grpc.aio.ServicerContext
    ) -> pb.MigrateResponse:
        """UNIMPLEMENTED: the router moves the requests it forwards itself (`jlora router
        --migration on`); an operator who wants a request's state calls the worker's."""
        await abort(
            context,
            RequestError(
                "the router does not export requests: it migrates the ones it forwards "
                "itself (jlora router --migration on); call Migrate on the worker",
                code=Code.UNIMPLEMENTED,
            ),
        )
