"""Adapters across the router's workers and the registry (`AdapterCatalog`).

- Register: the name and the directory are checked as every worker checks them
  (`jlora.contract.adapters`: the name rule, the path guard; `adapter_from_directory`
  reads a real PEFT adapter and its sha256, which must be the client's if it sent one),
  then
  registered on every worker that is up, by its path relative to that directory (rolled
  back on all if one refuses), then stored in the registry.
- A worker that comes (back) up gets the registry's adapters it lacks
  (`register_missing`), each weights file checked against its registered sha256 first;
  one that fails is recorded (`sync_error`), so a request for it gets the reason
  (DATA_LOSS for a file changed since it was registered) rather than NOT_FOUND.
- Load and Unload go to every worker that is up and has the adapter; Unregister to
  every one that has it, and to the registry. `entries()` (ListAdapters) merges the
  workers' answers with the registry's entries.

Blocking work (SQLite, hashing adapter files) runs in threads, never on the loop; one
adapter change runs at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc

from jlora.api import jlora_pb2 as pb
from jlora.contract import registry as reg
from jlora.contract.adapters import (
    WEIGHTS_FILE,
    Adapter,
    check_adapter_name,
    check_sha256,
    resolve_adapter_dir,
    sha256_of,
)
from jlora.contract.errors import (
    AlreadyExists,
    Code,
    FailedPrecondition,
    NotFound,
    RequestError,
    Unavailable,
)
from jlora.contract.status import from_rpc_error
from router.workers import Worker, WorkerPool

log = logging.getLogger(__name__)

T = TypeVar("T")

ADMIN_TIMEOUT = 30.0  # seconds for an adapter call to one worker


class AdapterCatalog:
    """See the module docstring. `base_model()` gives the base model's id (None while
    unknown); `users(name)` the Generate calls in flight that name an adapter."""

    def __init__(
        self,
        pool: WorkerPool,
        registry: reg.Registry,
        *,
        adapters_dir: Path | None,
        base_model: Callable[[], str | None],
        users: Callable[[str], int],
    ) -> None:
        self.pool = pool
        self.registry = registry
        self.adapters_dir = adapters_dir.resolve() if adapters_dir is not None else None
        self._base_model = base_model
        self._users = users
        self._lock = asyncio.Lock()
        self._sync_errors: dict[str, RequestError] = {}  # adapter -> why no worker has it

    def sync_error(self, name: str) -> RequestError | None:
        """Why the registered adapter `name` could not be given to a worker, if it could not."""
        return self._sync_errors.get(name)

    async def register(self, request: pb.RegisterAdapterRequest) -> pb.Adapter:
        if self.adapters_dir is None:
            raise FailedPrecondition(
                "the router has no adapters directory: start it with --adapters-dir to "
                "register adapters"
            )
        base = self._base_model()
        if base is None:
            raise Unavailable("no worker has answered yet: the base model is unknown")
        name = check_adapter_name(request.name, base_model=base)
        async with self._lock:
            entry = await asyncio.to_thread(
                reg.adapter_from_directory,
                name,
                request.path,
                adapters_dir=self.adapters_dir,
                base_model=base,
            )
            check_sha256(
                request.sha256 or None,
                entry.sha256,
                adapter=name,
                source=f"{entry.path}/{WEIGHTS_FILE}",
            )
            if await self.registered(name):
                raise AlreadyExists(f"adapter name={name!r} is already registered", field="name")
            workers = self.pool.up
            if not workers:
                raise Unavailable("no worker is up to register the adapter on")
            message = pb.RegisterAdapterRequest(
                name=name, path=entry.path, load=request.load, pin=request.pin, sha256=entry.sha256
            )
            done: list[Worker] = []
            try:
                for worker in workers:
                    reply = await _worker_call(
                        worker, worker.stub.RegisterAdapter(message, timeout=ADMIN_TIMEOUT)
                    )
                    worker.adapters[name] = reply.adapter
                    done.append(worker)
                await asyncio.to_thread(self.registry.register, entry)
            except RequestError:
                await self._unregister_on(done, name)
                raise
            self._sync_errors.pop(name, None)
        return _with_entry(done[0].adapters[name], entry)

    async def unregister(self, name: str) -> None:
        check_adapter_name(name)  # an empty or malformed name is the caller's, not unknown
        async with self._lock:
            users = self._users(name)
            if users:
                raise FailedPrecondition(
                    f"adapter {name!r} is named by {users} requests in flight", field="name"
                )
            registered = await self.registered(name)
            holders = [w for w in self.pool.up if name in w.adapters]
            if not registered and not holders:
                raise _not_registered(name)
            for worker in holders:
                await _worker_call(
                    worker,
                    worker.stub.UnregisterAdapter(
                        pb.UnregisterAdapterRequest(name=name), timeout=ADMIN_TIMEOUT
                    ),
                    missing_ok=True,
                )
                worker.adapters.pop(name, None)
            if registered:
                await asyncio.to_thread(self.registry.remove, name)
            self._sync_errors.pop(name, None)

    async def load(self, name: str, *, pin: bool) -> pb.Adapter:
        check_adapter_name(name)
        return await self._on_holders(
            name, lambda w: w.stub.LoadAdapter(pb.LoadAdapterRequest(name=name, pin=pin))
        )

    async def unload(self, name: str) -> pb.Adapter:
        check_adapter_name(name)
        return await self._on_holders(
            name, lambda w: w.stub.UnloadAdapter(pb.UnloadAdapterRequest(name=name))
        )

    async def _on_holders(self, name: str, call: Callable[[Worker], Awaitable[Any]]) -> pb.Adapter:
        """`call` on every worker that is up and has the adapter; the first one's adapter."""
        async with self._lock:
            holders = [w for w in self.pool.up if name in w.adapters]
            if not holders:
                raise _not_registered(name)
            for worker in holders:
                reply = await _worker_call(worker, call(worker))
                worker.adapters[name] = reply.adapter
            return _merge([w.adapters[name] for w in holders])

    async def entries(self) -> list[pb.Adapter]:
        """Every adapter a worker serves or the registry holds, merged by name."""
        await self.pool.refresh_adapters()
        by_name: dict[str, list[pb.Adapter]] = {}
        for worker in self.pool.workers:
            for adapter in worker.adapters.values():
                by_name.setdefault(adapter.name, []).append(adapter)
        entries = {
            e.name: e for e in await asyncio.to_thread(self.registry.list, self._base_model())
        }
        merged = []
        for name in sorted(by_name.keys() | entries.keys()):
            adapter = _merge(by_name[name]) if name in by_name else pb.Adapter(name=name, slot=-1)
            merged.append(_with_entry(adapter, entries[name]) if name in entries else adapter)
        return merged

    async def register_missing(self, worker: Worker) -> None:
        """Before `worker` takes requests (`WorkerPool(on_up=...)`): register the
        registry's adapters it lacks, each weights file checked against its sha256."""
        if self.adapters_dir is None:
            return
        async with self._lock:
            base = self._base_model() or worker.base_model
            for entry in await asyncio.to_thread(self.registry.list, base):
                if entry.name not in worker.adapters:
                    await self._register_entry(worker, entry, self.adapters_dir)

    async def _register_entry(self, worker: Worker, entry: Adapter, adapters_dir: Path) -> None:
        try:
            await asyncio.to_thread(verify_entry, entry, adapters_dir)
            reply = await worker.stub.RegisterAdapter(
                pb.RegisterAdapterRequest(name=entry.name, path=entry.path, sha256=entry.sha256),
                timeout=ADMIN_TIMEOUT,
            )
        except RequestError as err:
            self._sync_errors[entry.name] = err
            log.error("adapter %r is not served: %s", entry.name, err.message)
            return
        except grpc.aio.AioRpcError as err:
            error = from_rpc_error(err)
            if error.code != Code.ALREADY_EXISTS:
                error.message = f"worker {worker.address}: {error.message}"
                self._sync_errors[entry.name] = error
                log.error("worker %s refused adapter %r: %s", worker.address, entry.name, err)
            return
        worker.adapters[entry.name] = reply.adapter
        self._sync_errors.pop(entry.name, None)
        log.info("registered adapter %r on worker %s", entry.name, worker.address)

    async def registered(self, name: str) -> bool:
        try:
            await asyncio.to_thread(self.registry.get, name)
        except reg.AdapterNotFound:
            return False
        return True

    async def _unregister_on(self, workers: list[Worker], name: str) -> None:
        for worker in workers:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await worker.stub.UnregisterAdapter(
                    pb.UnregisterAdapterRequest(name=name), timeout=ADMIN_TIMEOUT
                )
            worker.adapters.pop(name, None)


def _merge(copies: list[pb.Adapter]) -> pb.Adapter:
    """One adapter as several workers report it: the furthest state, running requests
    summed, pinned if pinned anywhere; no single slot (-1)."""
    merged = pb.Adapter()
    merged.CopyFrom(copies[0])
    merged.state = max(copy.state for copy in copies)  # type: ignore[assignment]
    merged.running_requests = sum(copy.running_requests for copy in copies)
    merged.pinned = any(copy.pinned for copy in copies)
    merged.slot = copies[0].slot if len(copies) == 1 else -1
    return merged


def _with_entry(adapter: pb.Adapter, entry: Adapter) -> pb.Adapter:
    """The adapter with the registry's identity: its path, rank, targets and hash."""
    merged = pb.Adapter()
    merged.CopyFrom(adapter)
    merged.path, merged.sha256, merged.size_bytes = entry.path, entry.sha256, entry.size_bytes
    merged.rank, merged.alpha = entry.rank, entry.alpha
    del merged.target_modules[:]
    merged.target_modules.extend(entry.targets)
    return merged


def verify_entry(entry: Adapter, adapters_dir: Path) -> None:
    """The registered adapter's directory, guarded, still holds the weights it was
    registered with (DataLoss if its sha256 changed)."""
    directory = resolve_adapter_dir(entry.path, adapters_dir)
    weights = directory / WEIGHTS_FILE
    try:
        actual = sha256_of(weights)
    except OSError as err:
        raise FailedPrecondition(
            f"adapter {entry.name!r}: cannot read {weights} ({err})", field="path"
        ) from None
    check_sha256(entry.sha256, actual, adapter=entry.name, source=weights)


def _not_registered(name: str) -> NotFound:
    return NotFound(
        f"adapter name={name!r} is not registered", field="name", reason="ADAPTER_NOT_FOUND"
    )


async def _worker_call(worker: Worker, call: Awaitable[T], *, missing_ok: bool = False) -> T:
    """A unary call to a worker; its error, as the worker sent it."""
    try:
        return await call
    except grpc.aio.AioRpcError as err:
        if missing_ok and err.code() == grpc.StatusCode.NOT_FOUND:
            return None  # type: ignore[return-value]
        raise from_rpc_error(err) from None
