"""`Client`: the jlora.v1 API over a blocking gRPC channel."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jlora.api import jlora_pb2 as pb
from jlora.api import jlora_pb2_grpc as pb_grpc
from jlora.client.errors import error_from_rpc
from jlora.client.messages import Chat, Completion, Prompt, generate_request
from jlora.contract.auth import call_metadata
from jlora.contract.grpc_server import MESSAGE_OPTIONS


class Client:
    """A worker's or a router's jlora.v1 API at `target` ("host:port"), blocking.

    api_key: sent as `authorization: Bearer <key>` with every call. timeout: the
    seconds each call may take (a stream: all of it), unless the call says otherwise;
    None: no limit. A failed call raises the JloraError of its kind (jlora.client.errors).
    One client is safe to share between threads; close it (or use `with`) when done.
    """

    def __init__(
        self, target: str, *, api_key: str | None = None, timeout: float | None = None
    ) -> None:
        self.target = target
        self.timeout = timeout
        self._metadata = call_metadata(api_key)
        self._channel = grpc.insecure_channel(target, options=MESSAGE_OPTIONS)
        self._stub = pb_grpc.JloraStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- Generate ---------------------------------------------------------------------

    def generate(
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
        """The whole completion of a prompt (text or token ids) or of chat messages, on
        `adapter` (None: the base model), sampled as `sampling` and `fields` say (any
        SamplingParams field by name: max_tokens=16, temperature=0.7, stop=["\\n"],
        logprobs=5, ...; `jlora.client.messages.sampling_params`)."""
        request = generate_request(
            prompt,
            chat=chat,
            adapter=adapter,
            request_id=request_id,
            resume=resume,
            sampling=sampling,
            **fields,
        )
        return Completion.of(list(self._responses(request, timeout)))

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
    ) -> Generator[pb.GenerateResponse, None, None]:
        """Each GenerateResponse of `generate`'s request as it arrives, one per token; the
        last carries the finish reason and the usage. The call starts at the first
        `next()`; closing the iterator early cancels it (the server frees the request)."""
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

    def _responses(
        self, request: pb.GenerateRequest, timeout: float | None
    ) -> Generator[pb.GenerateResponse, None, None]:
        call = self._stub.Generate(request, timeout=self._timeout(timeout), metadata=self._metadata)
        try:
            yield from call
        except grpc.RpcError as err:
            raise error_from_rpc(err) from err
        finally:
            call.cancel()  # nothing to cancel once the stream has ended

    # -- adapters ---------------------------------------------------------------------

    def register_adapter(
        self,
        name: str,
        path: str,
        *,
        load: bool = False,
        pin: bool = False,
        sha256: str = "",
        timeout: float | None = None,
    ) -> pb.Adapter:
        """Registers the PEFT directory `path` (on the server) as `name`; with `load` also
        starts copying it to the device, with `pin` keeps it there. `sha256`: the hash
        adapter_model.safetensors must have (DataLoss if not)."""
        request = pb.RegisterAdapterRequest(name=name, path=path, load=load, pin=pin, sha256=sha256)
        return self._unary("RegisterAdapter", request, timeout).adapter

    def load_adapter(
        self, name: str, *, pin: bool = False, timeout: float | None = None
    ) -> pb.Adapter:
        """Starts copying a registered adapter to the device (it is LOADING, then DEVICE)."""
        return self._unary(
            "LoadAdapter", pb.LoadAdapterRequest(name=name, pin=pin), timeout
        ).adapter

    def unload_adapter(self, name: str, *, timeout: float | None = None) -> pb.Adapter:
        """Unpins an adapter and frees its device slot; it stays registered."""
        return self._unary("UnloadAdapter", pb.UnloadAdapterRequest(name=name), timeout).adapter

    def unregister_adapter(self, name: str, *, timeout: float | None = None) -> None:
        """Forgets an adapter (FailedPrecondition while a request names it)."""
        self._unary("UnregisterAdapter", pb.UnregisterAdapterRequest(name=name), timeout)

    def list_adapters(self, *, timeout: float | None = None) -> list[pb.Adapter]:
        return list(self._unary("ListAdapters", pb.ListAdaptersRequest(), timeout).adapters)

    # -- the server -------------------------------------------------------------------

    def models(self, *, timeout: float | None = None) -> list[pb.Model]:
        """The base model, then one entry per registered adapter."""
        return list(self._unary("Models", pb.ModelsRequest(), timeout).models)

    def stats(self, *, timeout: float | None = None) -> pb.StatsResponse:
        return self._unary("Stats", pb.StatsRequest(), timeout)

    def migrate(self, request_id: str, *, timeout: float | None = None) -> pb.MigrateResponse:
        """Takes a request out of a worker (its stream ends with Aborted, reason MIGRATED);
        resume it with generate(prompt=reply.prompt_ids, resume=...) elsewhere."""
        return self._unary("Migrate", pb.MigrateRequest(request_id=request_id), timeout)

    def health(self, service: str = "", *, timeout: float | None = None) -> bool:
        """Whether the server (or `service`, e.g. "jlora.v1.Jlora") is SERVING; False
        while it drains or after its device broke. Needs no API key."""
        request = health_pb2.HealthCheckRequest(service=service)
        try:
            reply = self._health.Check(request, timeout=self._timeout(timeout))
        except grpc.RpcError as err:
            raise error_from_rpc(err) from err
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    # -- calls ------------------------------------------------------------------------

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def _unary(self, method: str, request: Any, timeout: float | None) -> Any:
        rpc = getattr(self._stub, method)
        try:
            return rpc(request, timeout=self._timeout(timeout), metadata=self._metadata)
        except grpc.RpcError as err:
            raise error_from_rpc(err) from err
