"""A worker that spans several JAX processes (`jax.distributed`): process 0 leads, the
others follow its device engine's calls.

Multi-controller JAX runs one program on every process: every computation over the
mesh must be launched by every process, in the same order, with the same inputs. So:

1. Every process joins the group (`join`: `jax.distributed.initialize`, gloo
   collectives on CPU), loads the model, builds a `LlamaEngine` over the global mesh
   (each process holding its devices' shards) and compiles its steps.
2. Process 0 runs the server, the scheduler and the orchestrator over a `Leader`: a
   device engine that sends each call (the prefills, insert, generate, free; staging,
   dropping and installing adapters) to the followers, over one authenticated
   connection each (`multiprocessing.connection`, the coordinator's port + 1), before
   making it itself.
3. Each follower runs `follow`: it makes the same calls on its own engine, in the order
   they arrive, until the leader says close (or goes away).

Adapters: every process stages an adapter into its own host store (the same path: the
processes share a filesystem). Putting data on a mesh that spans processes waits for
every process to put its part, so a load cannot run on the leader's transfer thread
alone: every process copies an adapter to its devices and installs it at the leader's
`install_adapter`, between two steps (the transfer thread only marks it ready to).

KV swaps (the prefix cache's, jlora/engine/memory): the leader's memory manager decides them
as on one process. The gather of a swap-out and the scatter of a swap-in are launched
by every process in order, like a step; the copies between each process's devices and
its own host memory run beside the steps, on the leader's swap thread and on each
follower's own (`_Swaps`), each process moving only its devices' parts
(`steps.KVBlocks`). The leader's host blocks and staged copies are handles (`_Held`)
on the parts every process holds; the followers let theirs go when the leader's handle
is gone.

Faults: with a process gone the mesh cannot step, and a step already waiting on it
never returns. A follower whose connection closes makes the leader call `on_lost`
(the worker reports NOT_SERVING and exits); a follower whose leader goes away exits.
CPU assistance is not offered across processes (lora_mode ondemand or cached).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Client, Connection, Listener, wait
from typing import Any, cast

import numpy as np

from jlora.contract.adapters import Adapter
from jlora.contract.errors import RequestError
from jlora.device.llama_engine import LlamaEngine
from jlora.engine.device_api import (
    DecodeRow,
    DeviceEngine,
    HostBlocks,
    LogprobArrays,
    Memory,
    Payload,
    Prefilled,
    PrefillJob,
)

log = logging.getLogger(__name__)

GROUP_KEY_ENV = "JLORA_PROCESS_GROUP_KEY"  # the followers' connections are checked with it
CONNECT_TIMEOUT_S = 600.0  # a follower compiles its steps before it connects


@dataclasses.dataclass(eq=False)
class _Held:
    """KV copies of which every process holds its part: host blocks, or blocks staged on
    the devices for a restore. `ident` names them to the followers; `local` is the
    leader's part."""

    ident: int
    local: object


def join(coordinator: str, num_processes: int, process_id: int) -> None:
    """Join the process group (before any other use of jax)."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)


def _channel(coordinator: str) -> tuple[str, int]:
    host, _, port = coordinator.rpartition(":")
    return host, int(port) + 1


def _key() -> bytes:
    return os.environ.get(GROUP_KEY_ENV, "jlora-process-group").encode()


class Leader(DeviceEngine):
    """Process 0's device engine: `engine`'s calls, each sent to the followers first.

    `accept` waits for the followers' connections; `on_lost(reason)` is called (on a
    watcher thread) when one of them goes away.
    """

    def __init__(self, engine: LlamaEngine, followers: list[Connection]) -> None:
        self.engine = engine
        self.config = engine.config
        self.vocab_size = engine.vocab_size
        self.tokenizer = engine.tokenizer
        self._followers = followers
        self._lock = threading.Lock()  # stage/drop come from other threads than steps
        self._closing = False  # followers that leave after close() are not lost
        self._idents = itertools.count(1)  # of the KV copies the processes hold (`_Held`)
        self._forgotten: collections.deque[int] = collections.deque()  # gone, not yet told

    @classmethod
    def accept(
        cls,
        engine: LlamaEngine,
        coordinator: str,
        num_processes: int,
        on_lost: Callable[[str], None],
    ) -> Leader:
        followers: list[Connection] = []
        with Listener(_channel(coordinator), authkey=_key()) as listener:

            def accept_all() -> None:
                while len(followers) < num_processes - 1:
                    conn = listener.accept()
                    conn.recv()  # the follower's hello: it is ready to follow
                    followers.append(conn)

            accepting = threading.Thread(target=accept_all, name="jlora-accept", daemon=True)
            accepting.start()
            accepting.join(CONNECT_TIMEOUT_S)
        if len(followers) < num_processes - 1:
            raise RuntimeError(
                f"{num_processes - 1 - len(followers)} follower process(es) did not connect "
                f"within {CONNECT_TIMEOUT_S:.0f} s"
            )
        leader = cls(engine, followers)
        threading.Thread(
            target=leader._watch, args=(on_lost,), name="jlora-followers", daemon=True
        ).start()
        log.info("leading %d follower process(es)", len(followers))
        return leader

    def _watch(self, on_lost: Callable[[str], None]) -> None:
        """Followers never send after their hello: a readable connection is one closed."""
        closed = wait(self._followers)
        if not self._closing:
            index = self._followers.index(closed[0]) + 1  # type: ignore[arg-type]
            on_lost(f"follower process {index} went away")

    def _send(self, method: str, *args: Any) -> None:
        with self._lock:
            messages = [(method, args)]
            if self._forgotten:  # the followers let go of copies the leader no longer holds
                idents = [self._forgotten.popleft() for _ in range(len(self._forgotten))]
                messages.insert(0, ("kv_forget", (idents,)))
            for conn in self._followers:
                for message in messages:
                    conn.send(message)

    def _held(self, ident: int, local: object) -> _Held:
        """A handle on copies every process holds; when it is gone, so are the followers'
        (told with the next call: a finalizer may run on any thread, even inside `_send`)."""
        held = _Held(ident, local)
        weakref.finalize(held, self._forgotten.append, ident)
        return held

    # -- the device engine's calls, mirrored ----------------------------------------------

    def warmup(
        self,
        prompt_lengths: list[int] | None = None,
        max_length: int | None = None,
        *,
        on_demand: bool = False,
    ) -> None:
        # Compiling launches nothing; on demand, each process compiles in the step that
        # first needs a shape, which the followers run too.
        self.engine.warmup(prompt_lengths, max_length, on_demand=on_demand)

    def prefill(self, job: PrefillJob) -> Prefilled:
        self._send("prefill", job)
        return self.engine.prefill(job)

    def prefill_many(self, jobs: Sequence[PrefillJob]) -> list[Prefilled]:
        self._send("prefill_many", list(jobs))
        return self.engine.prefill_many(jobs)

    @property
    def packed_prefill_tokens(self) -> int:
        return self.engine.packed_prefill_tokens

    @property
    def packed_prefill_prompts(self) -> int:
        return self.engine.packed_prefill_prompts

    @property
    def packed_prefill_prompt_tokens(self) -> int:
        return self.engine.packed_prefill_prompt_tokens

    def insert(self, slot: int, row: DecodeRow) -> None:
        self._send("insert", slot, row)
        self.engine.insert(slot, row)

    def generate(self):  # type: ignore[no-untyped-def]
        self._send("generate")
        return self.engine.generate()

    def decode_logprobs(self) -> LogprobArrays | None:
        return self.engine.decode_logprobs()  # the followers' copies are the same

    def constrain(self, slot: int, allowed: np.ndarray | None) -> None:
        self._send("constrain", slot, allowed)
        self.engine.constrain(slot, allowed)

    def free(self, slot: int) -> None:
        self._send("free", slot)
        self.engine.free(slot)

    def stage_adapter(self, name: str, path: str, *, expect_sha256: str | None = None) -> Adapter:
        self._send("stage_adapter", name, path, expect_sha256)
        try:
            return self.engine.stage_adapter(name, path, expect_sha256=expect_sha256)
        except RequestError:
            self._send("drop_adapter", name)  # in case a follower's copy went through
            raise

    def drop_adapter(self, name: str) -> None:
        self._send("drop_adapter", name)
        self.engine.drop_adapter(name)

    def load_adapter(self, name: str, slot: int, pages: Sequence[int] | None = None) -> Payload:
        return pages  # every process copies it at install (see the module docstring)

    def install_adapter(self, name: str, slot: int, payload: Payload) -> None:
        pages = None if payload is None else list(cast(Sequence[int], payload))
        self._send("install_adapter", name, slot, pages)
        _load_and_install(self.engine, name, slot, pages)

    @property
    def adapter_slots(self) -> int:
        return self.engine.adapter_slots

    @property
    def can_swap_kv(self) -> bool:
        return True

    def kv_snapshot(self, blocks: Sequence[int]) -> object:
        ident = next(self._idents)
        self._send("kv_snapshot", ident, list(blocks))
        return ident, self.engine.kv_snapshot(blocks)

    def kv_to_host(self, snapshot: object) -> HostBlocks:
        ident, local = cast(tuple[int, object], snapshot)  # the followers' copies: theirs
        host = self.engine.kv_to_host(local)
        return HostBlocks(host.count, host.nbytes, self._held(ident, host))

    def kv_to_device(self, host: HostBlocks) -> object:
        held, ident = cast(_Held, host.data), next(self._idents)
        self._send("kv_to_device", ident, held.ident)
        local = cast(HostBlocks, held.local)
        return self._held(ident, self.engine.kv_to_device(local))

    def kv_restore(self, blocks: Sequence[int], staged: object) -> None:
        held = cast(_Held, staged)
        self._send("kv_restore", list(blocks), held.ident)
        self.engine.kv_restore(blocks, held.local)

    def memory(self) -> Memory:
        return self.engine.memory()

    def close(self) -> None:
        self._closing = True
        with contextlib.suppress(OSError):  # a follower gone already
            self._send("close")
        for conn in self._followers:
            conn.close()
        self.engine.close()


def follow(engine: LlamaEngine, coordinator: str, process_id: int) -> int:
    """A follower's life: connect to the leader, make its calls until it closes; the
    exit status (0: closed by the leader, 1: the leader went away)."""
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while True:
        try:
            conn = Client(_channel(coordinator), authkey=_key())
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    conn.send(("ready", process_id))
    log.info("process %d follows the leader", process_id)
    swaps = _Swaps(engine)
    with conn, contextlib.closing(swaps):
        while True:
            try:
                method, args = conn.recv()
            except (EOFError, OSError):
                log.error("process %d: the leader went away", process_id)
                return 1
            if method == "close":
                return 0
            if method == "install_adapter":
                _load_and_install(engine, *args)
            elif method == "stage_adapter":
                name, path, sha256 = args
                try:
                    engine.stage_adapter(name, path, expect_sha256=sha256)
                except RequestError as err:  # the leader refuses it too
                    log.info("process %d: adapter %r not staged: %s", process_id, name, err)
            elif method == "drop_adapter":
                if engine.store is not None and args[0] in engine.store:
                    engine.drop_adapter(args[0])
            elif method.startswith("kv_"):
                getattr(swaps, method)(*args)
            else:
                getattr(engine, method)(*args)


def _load_and_install(
    engine: LlamaEngine, name: str, slot: int, pages: Sequence[int] | None
) -> None:
    """Copy an adapter to this process's devices, into `pages` where the engine keeps
    adapters in its KV cache, and install it (every process in turn)."""
    engine.install_adapter(name, slot, engine.load_adapter(name, slot, pages))


class _Swaps:
    """A follower's side of the KV swaps: its devices' parts of the copies the leader
    holds handles on, by ident. The copies to and from host memory run on a thread of
    their own, in order (a staging reads the host copy before it), while the follower
    goes on with the leader's calls; a restore waits for its staging."""

    def __init__(self, engine: LlamaEngine) -> None:
        self.engine = engine
        self._copies: dict[int, Future[Any]] = {}
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="jlora-kv-swap")

    def kv_snapshot(self, ident: int, blocks: list[int]) -> None:
        snapshot = self.engine.kv_snapshot(blocks)
        self._copies[ident] = self._thread.submit(self.engine.kv_to_host, snapshot)

    def kv_to_device(self, ident: int, host: int) -> None:
        copy = self._copies[host]
        self._copies[ident] = self._thread.submit(lambda: self.engine.kv_to_device(copy.result()))

    def kv_restore(self, blocks: list[int], ident: int) -> None:
        self.engine.kv_restore(blocks, self._copies[ident].result())

    def kv_forget(self, idents: list[int]) -> None:
        for ident in idents:
            self._copies.pop(ident, None)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
