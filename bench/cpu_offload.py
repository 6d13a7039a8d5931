"""CPU LoRA workers against PyTorch, and the host-callback overhead of a CPU-routed layer.

Run: `python -m bench.cpu_offload [--quick] [--out FILE.md]` (a few minutes on a 2-core
CPU; `--quick` well under one). The report names the kernels OpenBLAS ran
(`openblas_core`): a machine that sets OPENBLAS_CORETYPE to an older core for every
process (as this project's development VMs do) slows the CPU LoRA kernel, not torch's;
`env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python -m bench.cpu_offload` measures
the kernels OpenBLAS picks for the CPU itself (leave tests and CI as they are).

1. Hand-off round trip: `submit` + `collect` of a tiny job (one row per worker,
   in 8, rank 1, out 8), so the time is the protocol (copy in, bump sequence numbers,
   wake, write DONE, copy out), not arithmetic. Median and p99 at 1, 2 and 8
   workers, every worker taking part. On a machine with fewer cores than workers
   the pool is oversubscribed (pinned workers share cores) and the table says so.
2. The kernel alone, in this process with one BLAS thread: `lora_rows` (two direct
   sgemm calls), the previous kernel (Numba `np.dot`, kept here as the baseline) and
   PyTorch's `x @ A @ B` (MKL) with one thread, at SmolLM2-135M shapes (in 576; out
   576 = q/o, 1536 = gate/up; ranks 8, 16 and 64; 128 and 512 rows).
3. The pool against PyTorch on the same threads (CaraServe §4.2, Fig. 18-Right): a
   product split across n threads, called as the engine calls it, everything it pays
   included (checks, the result written into a caller's buffer), against
   `x @ A @ B` with `torch.set_num_threads(n)`, for n = 1 and every core. Two pools:
   n threads of the calling process (`local_threads`: how the engine runs where the
   device is the CPU; `run`, straight from x), and n worker processes (how it runs
   beside an accelerator, and how it ran on a CPU until 2026-11-27; a submit, which
   copies x into shared memory and hands off, and a collect). Torch's n threads
   include its calling thread; the pool's are its calling thread and its team's
   helpers (`cpu_offload.kernels.team`). With every core, the pool of threads also runs as the
   engine calls it, picking its threads (`threads_for`: one, unless the product takes
   more than `target_ms` on one core). A and B live in a shared-memory arena laid
   out as the host store lays it out; torch reads the same memory
   (`torch.from_numpy`, no copy).
4. Host-callback overhead per CPU-routed layer (SmolLM2-135M, 128 tokens, 30 layers,
   an adapter on all 7 targets): a jitted scan in which each layer makes the four
   input groups' callback pairs (q/k/v, o, gate/up, down; f32[128, in] out, f32[128,
   out] back), against the same scan without them; the difference divided by the
   layers. Variants: `io_callback` pairs doing no work, ordered (the previous
   mechanism; bench/cold_start.py's method, 2.27 ms on 2026-11-22); `buffer_callback`
   pairs doing no work (the new mechanism's floor), and copying x out and a result in
   as the real callbacks do (the callback overhead proper: the comparable figure);
   one `buffer_callback` a group doing no work (the floor of `CpuAssist.apply`, the
   one callback a group makes where the products run on the engine's threads, until
   it became an XLA FFI handler on 2026-11-29: jlora/device/cpu_assist/apply.py, whose
   floor is a few µs a layer); and `CpuAssist`'s real ops over the real pool (this
   path: the FFI handler on the engine's threads, the callback pairs with worker
   processes), next to its products
   computed alone in this process on one thread, at rank 1 and 16, with the products
   on threads of this process and on worker processes. This path minus its products
   is the overhead with the hand-off included (the scan has no base projections for
   the products to overlap with); on several threads it can be below zero.

Timing: contenders that are compared run interleaved, call by call (or scan by scan;
in blocks of BLOCK calls in section 3), so that whatever else runs on the machine
slows both sides alike; one warm-up call, then medians (and p99 for the hand-off), in
microseconds. The report records the 1-minute load average at the start and at the
end, and how many shares the calling process computed (late workers' or fallbacks).
"""

from __future__ import annotations

import os

# One BLAS thread in this process too (the workers get one each): the kernel section
# compares one thread with one thread. Set before numpy or SciPy load OpenBLAS.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # noqa: E402
import functools  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from multiprocessing import shared_memory  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
from numba import njit  # noqa: E402

from cpu_offload import CpuLoraPool, LoraJob  # noqa: E402
from cpu_offload.kernels.blas import (  # noqa: E402
    blas_core,  # noqa: E402
    lora_rows,
    lora_task,
)
from cpu_offload.kernels.team import TEAM_SPIN_S  # noqa: E402

HIDDEN = 576
OUTS = (576, 1536)
RANKS = (8, 16, 64)
ROWS = (128, 512)
OVERHEAD_TOKENS = 128
# The pool and torch each leave threads spinning after a call (the workers for 2 ms,
# torch's OpenMP team for its spin count), which would slow the other side's next
# call: section 3 alternates blocks of calls, each after a pause and an untimed call.
BLOCK, BLOCK_GAP_S = 20, 0.05


@njit(cache=True)  # compiled at its first call: the spawned workers never call it
def numba_dot_rows(x, a, b, out):  # pragma: no cover - compiled
    """The previous kernel (until 2026-11-25): Numba's np.dot, a temporary, a copy."""
    out[:, :] = np.dot(np.dot(x, a), b)


def _interleaved_us(
    calls: dict[str, Callable[[], object]], iters: int, block: int = 1, gap_s: float = 0.0
) -> dict[str, list[float]]:
    """Microsecond samples of each call, the calls taking turns in blocks of `block`
    calls, each block after a pause of `gap_s` and one untimed call."""
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():
        call()
    for _ in range(max(1, iters // block)):
        for name, call in calls.items():
            if gap_s:
                time.sleep(gap_s)
                call()
            for _ in range(block):
                start = time.perf_counter()
                call()
                samples[name].append(1e6 * (time.perf_counter() - start))
    return samples


def _median(samples: Sequence[float]) -> float:
    return statistics.median(samples)


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


def _shapes() -> list[tuple[int, int, int]]:
    return [(rows, rank, out) for rows in ROWS for rank in RANKS for out in OUTS]


# -- 1. hand-off ---------------------------------------------------------------------


def _round_trip(pool: CpuLoraPool, x: np.ndarray, jobs: list[LoraJob], workers: int) -> object:
    return pool.collect(pool.submit(x, jobs, threads=workers))


def handoff(arena: Arena, iters: int) -> list[str]:
    cores = len(os.sched_getaffinity(0))
    lines = [
        "| workers | round trip median (µs) | p99 (µs) | note |",
        "|---:|---:|---:|---|",
    ]
    for workers in (1, 2, 8):
        with CpuLoraPool(arena.shm.name, workers=workers, max_rows=8, max_in=8, max_out=8) as pool:
            x = np.ones((workers, 8), np.float32)
            call = functools.partial(_round_trip, pool, x, [LoraJob(0, 0, 1, 8)], workers)
            samples = _interleaved_us({"pool": call}, iters)["pool"]
            fallbacks = pool.fallbacks
        note = f"oversubscribed: {workers} workers on {cores} cores" if workers > cores else ""
        if fallbacks:
            note += f" ({fallbacks} shares fell back to the caller)"
        p99 = float(np.percentile(samples, 99))
        lines.append(f"| {workers} | {_median(samples):.0f} | {p99:.0f} | {note} |")
    return lines


# -- 2. the kernel alone -------------------------------------------------------------


def _product(x: Any, a: Any, b: Any) -> Any:
    return x @ a @ b


def kernels(arena: Arena, iters: int) -> list[str]:
    import torch  # dev extra; imported here so spawned workers never load it

    torch.set_num_threads(1)
    lines = [
        "| rows | rank | out | lora_rows (µs) | previous np.dot kernel (µs) | torch x@A@B (µs) "
        "| torch / lora_rows | previous / lora_rows |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    rng = np.random.default_rng(1)
    for rows, rank, out in _shapes():
        a, b, _ = arena.tensors[rank, out]
        x = rng.standard_normal((rows, HIDDEN), np.float32)
        y = np.empty((rows, out), np.float32)
        x_t, a_t, b_t = torch.from_numpy(x), torch.from_numpy(a), torch.from_numpy(b)
        samples = _interleaved_us(
            {
                "ours": functools.partial(lora_rows, x, a, b, y),
                "previous": functools.partial(numba_dot_rows, x, a, b, y),
                "torch": functools.partial(_product, x_t, a_t, b_t),
            },
            iters,
        )
        ours, previous, torch_us = (_median(samples[k]) for k in ("ours", "previous", "torch"))
        lines.append(
            f"| {rows} | {rank} | {out} | {ours:.0f} | {previous:.0f} | {torch_us:.0f} "
            f"| {torch_us / ours:.2f} | {previous / ours:.2f} |"
        )
    return lines


# -- 3. the pool against torch on the same threads -----------------------------------


def _pooled(pool: CpuLoraPool, x: np.ndarray, job: LoraJob, threads: int, y: np.ndarray) -> object:
    """As the engine calls each pool: a pool of threads at once (`run`, nothing to
    overlap), worker processes by a submit and a collect."""
    if pool.local_threads:
        return pool.run(x, [job], threads=threads, out=y)
    return pool.collect(pool.submit(x, [job], threads=threads), out=y)


def products(arena: Arena, iters: int) -> list[str]:
    import torch

    cores = len(os.sched_getaffinity(0))
    thread_counts = sorted({1, cores})
    lines = [
        "| rows | rank | out | threads | pool of threads (µs) | pool of processes (µs) "
        "| torch x@A@B (µs) | torch / threads | torch / processes "
        f"| pool of threads, its pick of <= {cores} (µs) | torch / its pick |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    sizes = {"max_rows": max(ROWS), "max_in": HIDDEN, "max_out": max(OUTS)}
    with (
        CpuLoraPool(arena.shm.name, workers=0, local_threads=cores, **sizes) as threads_pool,
        CpuLoraPool(arena.shm.name, workers=cores, **sizes) as processes,
    ):
        rng = np.random.default_rng(1)
        for rows, rank, out in _shapes():
            x = rng.standard_normal((rows, HIDDEN), np.float32)
            y = np.empty((rows, out), np.float32)
            a, b, job = arena.tensors[rank, out]
            x_t, a_t, b_t = torch.from_numpy(x), torch.from_numpy(a), torch.from_numpy(b)
            for threads in thread_counts:
                torch.set_num_threads(threads)
                calls = {
                    "threads": functools.partial(_pooled, threads_pool, x, job, threads, y),
                    "processes": functools.partial(_pooled, processes, x, job, threads, y),
                    "torch": functools.partial(_product, x_t, a_t, b_t),
                }
                if threads == cores:  # as the engine calls it: the pool picks the threads
                    calls["pick"] = functools.partial(threads_pool.run, x, [job], out=y)
                samples = _interleaved_us(calls, iters, block=BLOCK, gap_s=BLOCK_GAP_S)
                us = {name: _median(times) for name, times in samples.items()}
                picked = (
                    f"{us['pick']:.0f} ({threads_pool.threads_for(rows, HIDDEN, rank, out)}) "
                    f"| {us['torch'] / us['pick']:.2f}"
                    if "pick" in us
                    else "- | -"
                )
                lines.append(
                    f"| {rows} | {rank} | {out} | {threads} | {us['threads']:.0f} "
                    f"| {us['processes']:.0f} | {us['torch']:.0f} "
                    f"| {us['torch'] / us['threads']:.2f} | {us['torch'] / us['processes']:.2f} "
                    f"| {picked} |"
                )
        lines.append(
            f"\nShares the calling process computed for late workers (processes): "
            f"{processes.steals}; fallbacks {processes.fallbacks}."
        )
    return lines


# -- 4. host-callback overhead per CPU-routed layer ----------------------------------


def _overhead_scans(config: Any, tokens: int, cpu: Any) -> dict[str, Callable[[Any], Any]]:
    """name -> a jitted scan over the model's layers: "none" (no callbacks), and the
    three kinds of callback pairs (module docstring, section 4)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import io_callback
    from jax.experimental.buffer_callback import buffer_callback

    from jlora.model.lora.targets import INPUT_GROUPS, target_shapes

    shapes = target_shapes(config)
    groups = [(shapes[names[0]][0], sum(shapes[n][1] for n in names)) for names in INPUT_GROUPS]
    length = jnp.int32(tokens)

    def io_pair(group: int, h: Any, layer: Any) -> Any:
        width = groups[group][1]

        def collect(ticket: np.ndarray) -> np.ndarray:
            return np.zeros((tokens, width), np.float32)

        ticket = io_callback(
            lambda h: np.int32(1), jax.ShapeDtypeStruct((), jnp.int32), h, ordered=True
        )
        return io_callback(
            collect, jax.ShapeDtypeStruct((tokens, width), jnp.float32), ticket, ordered=True
        )

    staged = [
        (np.empty((tokens, fan_in), np.float32), np.zeros((tokens, width), np.float32))
        for fan_in, width in groups
    ]

    def buffer_pair(group: int, h: Any, layer: Any, copies: bool = False) -> Any:
        """No-op buffer_callback pairs; with `copies`, the submit copies x out and the
        collect copies a [T, out] result in, as the real callbacks do."""
        x_copy, y_copy = staged[group]

        def submit(ctx: Any, flag: Any, h: Any) -> None:
            if copies:
                np.copyto(x_copy, np.asarray(h))
            np.asarray(flag)[...] = 1

        def collect(ctx: Any, out: Any, ticket: Any) -> None:
            if copies:
                np.copyto(np.asarray(out), y_copy)

        ticket = buffer_callback(submit, jax.ShapeDtypeStruct((), jnp.int32), has_side_effect=True)(
            h
        )
        return buffer_callback(
            collect,
            jax.ShapeDtypeStruct((tokens, groups[group][1]), jnp.float32),
            has_side_effect=True,
        )(ticket)

    def buffer_one(group: int, h: Any, layer: Any) -> Any:
        """One no-op buffer_callback taking h and giving a [T, out] result (the floor
        of `CpuAssist.apply`, the path where nothing overlaps the products)."""
        result = jax.ShapeDtypeStruct((tokens, groups[group][1]), jnp.float32)
        return buffer_callback(lambda ctx, out, h: None, result, has_side_effect=True)(h)

    def ours(group: int, h: Any, layer: Any) -> Any:
        shape = (tokens, groups[group][1])
        if not cpu.overlapped:
            return cpu.apply(group, jnp.int32(0), layer, h, length, shape)
        ticket = cpu.submit(group, jnp.int32(0), layer, h, length)
        return cpu.collect(group, jnp.int32(0), ticket, shape)

    def scan(pair: Callable[[int, Any, Any], Any] | None) -> Callable[[Any], Any]:
        def layer_fn(x: Any, layer: Any) -> tuple[Any, None]:
            for group, (fan_in, _) in enumerate(groups):
                h = jnp.broadcast_to(x[:, :1], (tokens, fan_in)) + layer  # the group's input
                h = jax.lax.optimization_barrier(h)  # in memory, as the base projections need
                x = x + (pair(group, h, layer)[:, :1] if pair else 0 * h[:, :1])
            return x, None

        layers = jnp.arange(config.num_layers, dtype=jnp.int32)
        return jax.jit(lambda x: jax.lax.scan(layer_fn, x, layers)[0])

    return {
        "none": scan(None),
        "io_callback": scan(io_pair),
        "buffer_callback": scan(buffer_pair),
        "buffer_copies": scan(functools.partial(buffer_pair, copies=True)),
        "buffer_one": scan(buffer_one),
        "ours": scan(ours),
    }


def _products(cpu: Any, layers: int, tokens: int, floats: np.ndarray) -> Callable[[], None]:
    """One scan's worth of the adapter's products, in this process on one thread: what
    the workers compute for the callbacks of every CPU-routed layer."""
    from cpu_offload.protocol import Task, out_stride
    from jlora.model.lora.targets import INPUT_GROUPS

    rng = np.random.default_rng(2)
    calls = []
    for group, names in enumerate(INPUT_GROUPS):
        fan_in, width = cpu.shapes[names[0]][0], cpu.widths[group]
        x = rng.standard_normal((tokens, fan_in), np.float32)
        y = np.empty((tokens, out_stride(width)), np.float32)[:, :width]
        for layer in range(layers):
            jobs, columns = cpu.layer_jobs(group, layer)
            if jobs:
                rows = Task(0, tokens, fan_in, width, tuple(jobs), tuple(columns)).job_rows()
                calls.append(functools.partial(lora_task, floats, x, y, rows))

    def run() -> None:
        for call in calls:
            call()

    return run


def _per_layer_us(
    cpu: Any, config: Any, x: Any, store: Any, iters: int
) -> tuple[float, dict[str, float]]:
    """(the scan without callbacks, µs; each variant's µs per layer beyond it), and the
    products alone per layer, for the adapter `cpu` is serving."""
    tokens, layers = x.shape[0], config.num_layers
    floats = np.frombuffer(store.arena.shm.buf, np.float32)
    scans = _overhead_scans(config, tokens, cpu)
    calls = {name: functools.partial(_block, fn, x) for name, fn in scans.items()}
    calls["products"] = _products(cpu, layers, tokens, floats)
    samples = _interleaved_us(calls, iters)
    base = _median(samples["none"])
    per_layer = {name: (_median(s) - base) / layers for name, s in samples.items()}
    per_layer["products"] = _median(samples["products"]) / layers
    return base, per_layer


def callback_overhead(iters: int) -> list[str]:
    import jax.numpy as jnp

    from configs.model import DEFAULT_MODEL, load_preset
    from jlora.adapters.peft import make_demo_adapters
    from jlora.adapters.store import HostStore
    from jlora.device.cpu_assist.callbacks import CpuAssist, default_workers
    from jlora.model.lora.targets import TARGETS, target_shapes

    config = load_preset(DEFAULT_MODEL).config
    tokens, layers, ranks = OVERHEAD_TOKENS, config.num_layers, (1, 16)
    store = HostStore(config, 64 << 20)
    workers, rows, notes = default_workers(), [], []
    try:
        with tempfile.TemporaryDirectory() as root:
            for rank in ranks:
                [path] = make_demo_adapters(config, Path(root) / f"r{rank}", n=1, ranks=[rank])
                store.register(f"r{rank}", path)
        x = jnp.ones((tokens, config.hidden_size), jnp.float32)
        for threads in (True, False):
            where = f"{workers + 1} threads" if threads else f"{workers} worker process(es)"
            cpu = CpuAssist(
                store.arena.name,
                target_shapes(config),
                workers=workers,
                threads=threads,
                max_rows=tokens,
            )
            try:
                for rank in ranks:
                    cpu.begin(store.get(f"r{rank}"))
                    try:
                        rows.append((where, rank, *_per_layer_us(cpu, config, x, store, iters)))
                    finally:
                        cpu.end()
                notes.append(
                    f"{where}: {cpu.pool.steals} shares taken from late workers, "
                    f"{cpu.pool.fallbacks} fallbacks"
                )
            finally:
                cpu.close()
    finally:
        store.close()
    lines = [
        f"{DEFAULT_MODEL}, {tokens} tokens, {layers} layers, all {len(TARGETS)} targets "
        f"adapted; the scan without callbacks took {rows[0][2] / 1e3:.2f} ms. Per "
        "CPU-routed layer, in µs, beyond that scan; overhead = this path - its products:",
        "",
        "| CPU LoRA on | rank | io_callback pairs, no work (previous) | buffer_callback "
        "pairs, no work | buffer_callback pairs + the copies (callback overhead) | "
        "previous / callback overhead | one buffer_callback a group, no work | this path | "
        "its products alone (one thread) | overhead with the hand-off |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for where, rank, _, layer in rows:
        copies = layer["buffer_copies"]
        lines.append(
            f"| {where} | {rank} | {layer['io_callback']:.0f} | "
            f"{layer['buffer_callback']:.0f} | {copies:.0f} | "
            f"{layer['io_callback'] / copies:.1f} | {layer['buffer_one']:.0f} | "
            f"{layer['ours']:.0f} | {layer['products']:.0f} | "
            f"{layer['ours'] - layer['products']:.0f} |"
        )
    lines.append(f"\nShares computed by the calling process: {'; '.join(notes)}.")
    return lines


def _block(fn: Callable[[Any], Any], x: Any) -> None:
    import jax

    jax.block_until_ready(fn(x))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer timed calls")
    parser.add_argument("--out", type=Path, help="also write the report to this file")
    args = parser.parse_args()
    # bench.report imports jax; imported here so spawned workers (which re-import this
    # module as __mp_main__) never load it.
    from bench.lib.report import machine_facts

    facts = {
        **machine_facts(),
        "openblas_core": blas_core(),  # the workers' too: they inherit the environment
        "OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE", "(not set)"),
        "team_spin_ms": TEAM_SPIN_S * 1e3,  # how long a pool's helper threads stay awake
    }
    arena = Arena()
    try:
        lines = ["# CPU LoRA workers (cpu_offload) and CPU-routed layers", ""]
        lines += [f"- {key}: {value}" for key, value in facts.items()]
        lines += ["", "## Shared-memory hand-off (tiny job, one row per worker)", ""]
        lines += handoff(arena, iters=200 if args.quick else 2000)
        lines += ["", "## The kernel alone: one thread each, interleaved (in 576)", ""]
        lines += kernels(arena, iters=20 if args.quick else 200)
        lines += ["", "## The pool vs PyTorch threads, interleaved (in 576)", ""]
        lines += products(arena, iters=20 if args.quick else 200)
        lines += ["", "## Host-callback overhead per CPU-routed layer, interleaved", ""]
        lines += callback_overhead(iters=5 if args.quick else 30)
    finally:
        arena.close()
    lines += ["", f"- load_avg_1min_end: {os.getloadavg()[0]}"]
    report = "\n".join(lines)
    print(report)
    if args.out:
        args.out.write_text(report + "\n")


if __name__ == "__main__":
    main()
