"""CPU LoRA workers: the shared-memory hand-off, and Numba workers against PyTorch threads.

Run: `python -m bench.cpu_offload [--quick]` (about a minute; `--quick` a few seconds
of timing plus the workers' start-up).

1. Hand-off round trip: `submit` + `collect` of a tiny job (one row per worker,
   in 8, rank 1, out 8), so the time is the protocol (copy in, bump sequence numbers,
   wake, write DONE, copy out), not arithmetic. Median and p99 at 1, 2 and 8
   workers, every worker taking part. On a machine with fewer cores than workers
   the pool is oversubscribed (pinned workers share cores) and the table says so.
2. Product x @ A @ B at SmolLM2-135M shapes (in 576; out 576 = q/o, 1536 = gate/up;
   rank 16 and 64; 128 and 512 rows): the pool split across n workers (hand-off
   included) against PyTorch's `x @ A @ B` with `torch.set_num_threads(n)`, for n
   = 1 and every core. A and B live in a shared-memory arena laid out as the host
   store lays it out; torch reads the same memory (`torch.from_numpy`, no copy).

Timing: one warm-up call, then the median (and p99) of `iters` calls, in
microseconds. The workers and the coordinator share the machine with whatever else
runs on it: the table records the 1-minute load average at the start.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from collections.abc import Callable
from multiprocessing import shared_memory
from typing import Any

import numpy as np

from cpu_offload import CpuLoraPool, LoraJob

HIDDEN = 576
OUTS = (576, 1536)
RANKS = (16, 64)
ROWS = (128, 512)


def _round_trip(pool: CpuLoraPool, x: np.ndarray, jobs: list[LoraJob], workers: int) -> object:
    return pool.collect(pool.submit(x, jobs, workers=workers))


def _product(x: Any, a: Any, b: Any) -> Any:
    return x @ a @ b


def _times_us(call: Callable[[], object], iters: int) -> tuple[float, float]:
    call()
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        call()
        samples.append(1e6 * (time.perf_counter() - start))
    return statistics.median(samples), float(np.percentile(samples, 99))


class Arena:
    """A shared-memory segment with one A [576, r] and B [r, out] per (rank, out)."""

    def __init__(self) -> None:
        rng = np.random.default_rng(0)
        self.tensors: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, LoraJob]] = {}
        nbytes = sum(4 * rank * (HIDDEN + out) for rank in RANKS for out in OUTS)
        self.shm = shared_memory.SharedMemory(create=True, size=nbytes)
        cursor = 0
        for rank in RANKS:
            for out in OUTS:
                a = self._view(cursor, (HIDDEN, rank))
                b = self._view(cursor + 4 * HIDDEN * rank, (rank, out))
                a[...] = rng.standard_normal(a.shape, np.float32) / np.float32(np.sqrt(HIDDEN))
                b[...] = rng.standard_normal(b.shape, np.float32) / np.float32(np.sqrt(rank))
                job = LoraJob(cursor, cursor + 4 * HIDDEN * rank, rank, out)
                self.tensors[rank, out] = (a, b, job)
                cursor += 4 * rank * (HIDDEN + out)

    def _view(self, offset: int, shape: tuple[int, int]) -> np.ndarray:
        return np.ndarray(shape, np.float32, buffer=self.shm.buf, offset=offset)

    def close(self) -> None:
        self.tensors.clear()
        self.shm.close()
        self.shm.unlink()


def handoff(arena: Arena, iters: int) -> list[str]:
    cores = len(os.sched_getaffinity(0))
    lines = [
        "| workers | round trip median (µs) | p99 (µs) | note |",
        "|---:|---:|---:|---|",
    ]
    for workers in (1, 2, 8):
        with CpuLoraPool(arena.shm.name, workers=workers, max_rows=8, max_in=8, max_out=8) as pool:
            x = np.ones((workers, 8), np.float32)
            median, p99 = _times_us(
                functools.partial(_round_trip, pool, x, [LoraJob(0, 0, 1, 8)], workers), iters
            )
            fallbacks = pool.fallbacks
        note = f"oversubscribed: {workers} workers on {cores} cores" if workers > cores else ""
        if fallbacks:
            note += f" ({fallbacks} shares fell back to the caller)"
        lines.append(f"| {workers} | {median:.0f} | {p99:.0f} | {note} |")
    return lines


def products(arena: Arena, iters: int) -> list[str]:
    import torch  # dev extra; imported here so spawned workers never load it

    thread_counts = sorted({1, len(os.sched_getaffinity(0))})
    lines = [
        "| rows | rank | out | threads | Numba pool (µs) | torch x@A@B (µs) | torch / pool |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    workers = max(thread_counts)
    with CpuLoraPool(
        arena.shm.name, workers=workers, max_rows=max(ROWS), max_in=HIDDEN, max_out=max(OUTS)
    ) as pool:
        rng = np.random.default_rng(1)
        for rows in ROWS:
            x = rng.standard_normal((rows, HIDDEN), np.float32)
            x_torch = torch.from_numpy(x)
            for rank in RANKS:
                for out in OUTS:
                    a, b, job = arena.tensors[rank, out]
                    a_torch, b_torch = torch.from_numpy(a), torch.from_numpy(b)
                    for threads in thread_counts:
                        torch.set_num_threads(threads)
                        pool_us, _ = _times_us(
                            functools.partial(_round_trip, pool, x, [job], threads), iters
                        )
                        torch_us, _ = _times_us(
                            functools.partial(_product, x_torch, a_torch, b_torch), iters
                        )
                        lines.append(
                            f"| {rows} | {rank} | {out} | {threads} | {pool_us:.0f} | "
                            f"{torch_us:.0f} | {torch_us / pool_us:.2f} |"
                        )
        if pool.fallbacks:
            lines.append(f"\n{pool.fallbacks} shares fell back to the calling process.")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer timed calls")
    args = parser.parse_args()
    # bench.report imports jax; imported here so spawned workers (which re-import this
    # module as __mp_main__) never load it.
    from bench.report import machine_facts

    facts = machine_facts()
    arena = Arena()
    try:
        lines = ["# CPU LoRA workers (cpu_offload)", ""]
        lines += [f"- {key}: {value}" for key, value in facts.items()]
        lines += ["", "## Shared-memory hand-off (tiny job, one row per worker)", ""]
        lines += handoff(arena, iters=200 if args.quick else 2000)
        lines += ["", "## x @ A @ B: Numba workers vs PyTorch threads (in 576)", ""]
        lines += products(arena, iters=5 if args.quick else 30)
    finally:
        arena.close()
    print("\n".join(lines))


if __name__ == "__main__":
    main()
