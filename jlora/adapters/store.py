"""The host store: every registered adapter, resident in one shared-memory arena.

Memory layout. The arena is one POSIX shared-memory segment (`/dev/shm/<name>`),
carved first-fit into 64-byte-aligned regions, one per adapter. A region is
layer-major, float32, with the scaling already folded into B:

    region = layer 0 | layer 1 | ... | layer L-1          (each `layer_stride` bytes)
    layer  = A[q_proj] [in, r] | B[q_proj] [r, out] | A[k_proj] | B[k_proj] | ...

(only the adapter's own targets, in canonical order). So one layer group is one
contiguous byte range that can be copied to the device on its own (Toppings §4.1,
pipelined loading), and a CPU worker process that attaches the segment by name reads
any layer's A and B in place, without a copy per call.

Registration validates the adapter completely (`load_peft_adapter`) before the arena
is touched, so a bad adapter changes nothing. It may run on any thread, beside the
steps and the transfers that read other regions: the allocator and the table of
adapters are guarded by a lock, and the copy into a fresh region runs outside it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import threading
import weakref
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np

from configs import ModelConfig
from jlora.adapters.peft import load_peft_adapter
from jlora.contract.adapters import WEIGHTS_FILE, Adapter, check_sha256
from jlora.contract.errors import AlreadyExists, ResourceExhausted
from jlora.model.lora.targets import TARGETS, rank_row_bytes, target_shapes

ALIGN = 64


def store_bytes(config: ModelConfig, ranks: list[int], targets: tuple[str, ...] = TARGETS) -> int:
    """The arena bytes that hold one adapter of each rank in `ranks` on `targets` (each
    region float32 and aligned)."""
    per_rank = rank_row_bytes(target_shapes(config), targets, config.num_layers, 4)
    return sum(-(-rank * per_rank // ALIGN) * ALIGN for rank in ranks)


def store_mib(config: ModelConfig, ranks: list[int], targets: tuple[str, ...] = TARGETS) -> int:
    """`host_store_mib` for `store_bytes(config, ranks, targets)`, at least the default 1024
    (benchmarks size their stores with it: a Llama-2-7B adapter of rank 16 on every target
    takes 160 MB)."""
    return max(1024, -(-store_bytes(config, ranks, targets) // 2**20))


@dataclasses.dataclass(frozen=True)
class Region:
    """Where one adapter lives in the arena (`adapter`: its record, host_bytes filled in)."""

    adapter: Adapter
    offset: int  # byte offset of the region in the arena
    layer_stride: int  # bytes per layer
    num_layers: int
    # target -> (byte offset of A, byte offset of B) within a layer
    target_offsets: dict[str, tuple[int, int]]

    @property
    def nbytes(self) -> int:
        return self.layer_stride * self.num_layers


class SharedArena:
    """A shared-memory segment with a first-fit allocator of aligned regions."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"host store capacity={capacity} must be positive")
        free_shm = shutil.disk_usage("/dev/shm").free if Path("/dev/shm").is_dir() else None
        if free_shm is not None and capacity > free_shm:
            raise ValueError(
                f"host store capacity={capacity} bytes exceeds the {free_shm} bytes free "
                "in /dev/shm; lower host_store_mib"
            )
        self.capacity = capacity
        self.shm = shared_memory.SharedMemory(create=True, size=capacity)
        self._finalizer = weakref.finalize(self, _unlink, self.shm)
        self._free: list[tuple[int, int]] = [(0, capacity)]  # sorted (offset, size)
        self._used: dict[int, int] = {}  # offset -> size

    @property
    def name(self) -> str:
        return self.shm.name

    @property
    def bytes_used(self) -> int:
        return sum(self._used.values())

    def alloc(self, nbytes: int) -> int:
        size = -(-max(nbytes, 1) // ALIGN) * ALIGN
        for i, (offset, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (offset + size, free - size)
                self._used[offset] = size
                return offset
        raise MemoryError(
            f"the host store has no free region of {size} bytes "
            f"({self.capacity - self.bytes_used} of {self.capacity} free, fragmented); "
            "raise host_store_mib or unregister adapters"
        )

    def free(self, offset: int) -> None:
        size = self._used.pop(offset)
        self._free.append((offset, size))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for start, length in self._free:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((start, length))
        self._free = merged

    def view(self, offset: int, shape: tuple[int, ...], strides: tuple[int, ...] | None = None):
        """A float32 numpy view of the arena at `offset` (no copy)."""
        buf = self.shm.buf
        assert buf is not None
        return np.ndarray(shape, np.float32, buffer=buf, offset=offset, strides=strides)

    def close(self) -> None:
        self._finalizer()


def _unlink(shm: shared_memory.SharedMemory) -> None:
    with contextlib.suppress(BufferError):  # numpy views still alive: unmapped with them
        shm.close()
    with contextlib.suppress(FileNotFoundError):
        shm.unlink()


class HostStore:
    """Registered adapters by name, each validated against one base model."""

    def __init__(self, config: ModelConfig, capacity: int) -> None:
        self.config = config
        self.shapes = target_shapes(config)
        self.arena = SharedArena(capacity)
        self._adapters: dict[str, Region] = {}
        self._lock = threading.Lock()  # the arena's allocator and `_adapters`

    def __contains__(self, name: object) -> bool:
        return name in self._adapters

    def __len__(self) -> int:
        return len(self._adapters)

    def names(self) -> list[str]:
        return list(self._adapters)

    def get(self, name: str) -> Region:
        return self._adapters[name]

    def register(self, name: str, path: str | Path, *, expect_sha256: str | None = None) -> Region:
        """Validate the PEFT adapter at `path` (and its weights' sha256 against
        `expect_sha256`) and copy it into the arena as `name`. Any thread.

        Raises RequestError (and changes nothing) for a duplicate name, an invalid
        adapter, a hash mismatch or a full arena.
        """
        loaded = load_peft_adapter(Path(path), self.config)
        adapter = loaded.adapter
        check_sha256(expect_sha256, adapter.sha256, adapter=name, source=Path(path) / WEIGHTS_FILE)
        target_offsets, cursor = {}, 0
        for target in adapter.targets:
            fan_in, fan_out = self.shapes[target]
            target_offsets[target] = (cursor, cursor + 4 * fan_in * adapter.rank)
            cursor += 4 * adapter.rank * (fan_in + fan_out)
        num_layers = self.config.num_layers
        with self._lock:
            if name in self._adapters:
                raise AlreadyExists(f"adapter name={name!r} is already registered", field="name")
            try:
                offset = self.arena.alloc(cursor * num_layers)
            except MemoryError as err:
                raise ResourceExhausted(f"adapter {name!r}: {err}", field="path") from None
        stored = Region(
            adapter=dataclasses.replace(adapter, name=name, host_bytes=cursor * num_layers),
            offset=offset,
            layer_stride=cursor,
            num_layers=num_layers,
            target_offsets=target_offsets,
        )
        for target, (lora_a, lora_b) in loaded.weights.items():
            view_a, view_b = self._stacked(stored, target)
            view_a[...] = lora_a
            view_b[...] = lora_b
        with self._lock:
            self._adapters[name] = stored
        return stored

    def unregister(self, name: str) -> None:
        with self._lock:
            stored = self._adapters.pop(name)
            self.arena.free(stored.offset)

    def _stacked(self, stored: Region, target: str) -> tuple[np.ndarray, np.ndarray]:
        fan_in, fan_out = self.shapes[target]
        rank = stored.adapter.rank
        a_off, b_off = stored.target_offsets[target]
        layer = stored.layer_stride
        view_a = self.arena.view(
            stored.offset + a_off, (stored.num_layers, fan_in, rank), (layer, 4 * rank, 4)
        )
        view_b = self.arena.view(
            stored.offset + b_off, (stored.num_layers, rank, fan_out), (layer, 4 * fan_out, 4)
        )
        return view_a, view_b

    def tensors(self, name: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """target -> (A [L, in, r], B·scaling [L, r, out]): strided views into the arena."""
        stored = self._adapters[name]
        return {target: self._stacked(stored, target) for target in stored.adapter.targets}

    def close(self) -> None:
        """Release the shared-memory segment (views into it become invalid)."""
        with self._lock:
            self._adapters.clear()
            self.arena.close()
