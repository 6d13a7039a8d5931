"""`AsyncClient`: the jlora.v1 API over a grpc.aio channel, for asyncio programs."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jlora.api import jlora_pb2 as pb
from jlora.api import jlora_pb2_grpc as pb_grpc
from jlora.client.errors import error_from_rpc
from jlora.client.messages import Chat, Completion, Prompt, generate_request
from jlora.contract.auth import call_metadata
from jlora.contract.grpc_server import MESSAGE_OPTIONS


class AsyncClient:
    """`jlora.client.Client` for asyncio: the same methods and errors, each a coroutine
    but `stream`, an async iterator. Create it inside the event loop it is used on (as
    any grpc.aio channel) and `await close()` it, or use `async with`.
    """

    def __init__(
        self, target: str, *, api_key: str | None = None, timeout: float | None = None
    ) -> None:
        self.target = target
        self.timeout = timeout
        self._metadata = call_metadata(api_key)
        self._channel = grpc.aio.insecure_channel(target, options=MESSAGE_OPTIONS)
        self._stub = pb_grpc.JloraStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- Generate ---------------------------------------------------------------------

    async def generate(
        self,
        prompt: Prompt | None = None,
        *,
        chat: Chat | None = None,
        adapter: str | None = None,
        request_id: str = "",
        resume: pb.ResumeState | None = None,
        sampling: pb.SamplingParams | None = None,
        timeout: float | None = None,
        **fields: Any,
    ) -> Completion:
        """The whole completion (`Client.generate`)."""
        request = generate_request(
            prompt,
            chat=chat,
            adapter=adapter,
            request_id=request_id,
            resume=resume,
            sampling=sampling,
            **fields,
        )
        return Completion.of([r async for r in self._responses(request, timeout)])

    def stream(
        self,
        prompt: Prompt | None = None,
        *,
        chat: Chat | None = None,
        adapter: str | None = None,
        request_id: str = "",
        resume: pb.ResumeState | None = None,
        sampling: pb.SamplingParams | None = None,
        timeout: float | None = None,
        **fields: Any,
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        """Each GenerateResponse as it arrives (`Client.stream`): `async for` over it; the
        call starts at the first one, and `aclose()` before the end cancels it."""
        request = generate_request(
            prompt,
            chat=chat,
            adapter=adapter,
            request_id=request_id,
            resume=resume,
            sampling=sampling,
            **fields,
        )
        return self._responses(request, timeout)

    async def _responses(
        self, request: pb.GenerateRequest, timeout: float | None
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        call = self._stub.Generate(request, timeout=self._timeout(timeout), metadata=self._metadata)
        try:
            async for response in call:
                yield response
        except grpc.RpcError as err:
            raise error_from_rpc(err) from err
        finally:
            call.cancel()  # nothing to cancel once the stream has ended

    # -- adapters ---------------------------------------------------------------------

    async def register_adapter(
        self,
        name: str,
        path: str,
        *,
        load: bool = False,
        pin: bool = False,
        sha256: str = "",
        timeout: float | None = None,
    ) -> pb.Adapter:
        """`Client.register_adapter`."""
        request = pb.RegisterAdapterRequest(name=name, path=path, load=load, pin=pin, sha256=sha256)
        return (await self._unary("RegisterAdapter", request, timeout)).adapter

    async def load_adapter(
        self, name: str, *, pin: bool = False, timeout: float | None = None
    ) -> pb.Adapter:
        request = pb.LoadAdapterRequest(name=name, pin=pin)
        return (await self._unary("LoadAdapter", request, timeout)).adapter

    async def unload_adapter(self, name: str, *, timeout: float | None = None) -> pb.Adapter:
        request = pb.UnloadAdapterRequest(name=name)
        return (await self._unary("UnloadAdapter", request, timeout)).adapter

    async def unregister_adapter(self, name: str, *, timeout: float | None = None) -> None:
        await self._unary("UnregisterAdapter", pb.UnregisterAdapterRequest(name=name), timeout)

    async def list_adapters(self, *, timeout: float | None = None) -> list[pb.Adapter]:
        return list((await self._unary("ListAdapters", pb.ListAdaptersRequest(), timeout)).adapters)

    # -- the server -------------------------------------------------------------------

    async def models(self, *, timeout: float | None = None) -> list[pb.Model]:
        return list((await self._unary("Models", pb.ModelsRequest(), timeout)).models)

    async def stats(self, *, timeout: float | None = None) -> pb.StatsResponse:
        return await self._unary("Stats", pb.StatsRequest(), timeout)

    async def migrate(self, request_id: str, *, timeout: float | None = None) -> pb.MigrateResponse:
        return await self._unary("Migrate", pb.MigrateRequest(request_id=request_id), timeout)

    async def health(self, service: str = "", *, timeout: float | None = None) -> bool:
        """`Client.health`."""
        request = health_pb2.HealthCheckRequest(service=service)
        try:
            reply = await self._health.Check(request, timeout=self._timeout(timeout))
        except grpc.RpcError as err:
            raise error_from_rpc(err) from err
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    # -- calls ------------------------------------------------------------------------

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    async def _unary(self, method: str, request: Any, timeout: float | None) -> Any:
        rpc = getattr(self._stub, method)
        try:
            return await rpc(request, timeout=self._timeout(timeout), metadata=self._metadata)
        except grpc.RpcError as err:
            raise error_from_rpc(err) from err
