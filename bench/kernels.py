"""Decode LoRA kernels (BGMV, MBGMV) against memory bandwidth, and the papers' linear models.

Run: `python -m bench.kernels [--quick] [--batches 1,16,...] [--ranks 16,64,...] [--tune]
[--json PATH] [--markdown PATH]` (on a GPU the full plan: a few minutes, mostly
compilation; `--quick` is the CPU smoke run). `--tune` also times TUNE_VARIANTS' kernel
settings (warps, pipelining stages, block sizes, expand's rank chunk) on a few batches.

Shape: Llama-2-7B's q_proj (4096 -> 4096, bfloat16), one layer per kernel call.
Each decode row has its own adapter (row s on slot s: nothing shared for a cache).
Batches |S| = 1, 2, 4, 8, 16, 32, 64 at uniform ranks 8, 16, 32, 64, 128 (max/mean
rank 1), and mixed batches whose rows cycle through a pattern, at each |S| that is a
multiple of its length (so max/mean is exact): 128, 64, 32, 32 (max/mean 2);
128, 32, 16 x 6 (4); 128, 16, 8 x 14 (8). All ranks are multiples of the kernels'
rank chunk (8), so no masked rank rows are read.

BGMV reads stacked slots a, b [L, |S|, R, 4096], R the power of two >= the max rank;
MBGMV a pool of Σr rank rows per layer, each slot's rows scattered through it by its
page table (a numpy permutation); weights are drawn on the device. Bytes per call:

    BGMV:  |S| · max r · (in + out) · itemsize + |S| · (in + 2 · out) · itemsize
    MBGMV:     Σ_s r_s · (in + out) · itemsize + |S| · (in + 2 · out) · itemsize

adapter rows, then x read and y read and written (the f32 [|S|, R] intermediate and
index tables left out). Achieved bytes/s = bytes / median time, also as a fraction
of a device-to-device copy timed in the same run (jitted `jnp.copy` of 1 GiB; each
byte is read and written, so copy bytes/s = 2 · size / time).

Timing: one jitted `lax.fori_loop` makes `iters` calls, call i on layer i % L with y
carried, so Python dispatch is paid once per loop. L layers hold >= 256 MiB of
adapter rows (an H100's or H200's L2 is 50 MB), so no call finds its rows in cache,
as in a decode step through all layers; iters = max(L, 50). One untimed run
(compilation, warm-up), then 5 timed; time per call = median run / iters.

Fits: least squares over all decode points of CaraServe's (§5) models, Perf_BGMV =
α · |S| · max r + β and Perf_MBGMV = α · Σr + β (µs), and each kernel against the
other's model for contrast. SGMV (prefill): T = 128, 512, 2048 tokens in 1 or 8
equal segments (distinct adapters) of rank 16 or 64; FLOP/s = 2 · T · r · (in + out)
/ time.

Off GPU the kernels run in Pallas interpret mode (`jax.default_backend() != "gpu"`):
times measure the interpreter, not memory traffic, and the report says so. `--quick`
(under a minute on two idle cores) uses SmolLM2's 576 -> 576 in float32, |S| = 1, 4,
16, ranks 8, 32, the same mixes, SGMV at T = 128, rank 16; one layer, 10 calls a run.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import pallas_kernels.bgmv.kernel as bgmv_kernel
import pallas_kernels.mbgmv.kernel as mbgmv_kernel
from bench.lib import report
from configs import load_preset
from pallas_kernels import common
from pallas_kernels.bgmv import bgmv
from pallas_kernels.mbgmv import mbgmv
from pallas_kernels.sgmv import sgmv

MIXED_RANKS = ((128, 64, 32, 32), (128, 32, *[16] * 6), (128, 16, *[8] * 14))
# `--tune`: kernel settings tried on a few decode batches, each a {module attribute: value}
# applied to pallas_kernels.common and both decode kernels' modules (defaults first).
TUNE_RANKS = ((16,), (64,), (128, 16, *[8] * 14))
TUNE_VARIANTS: dict[str, dict[str, int]] = {
    "default (4 warps, blocks 512)": {},
    "8 warps": {"NUM_WARPS": 8},
    "blocks 1024": {"IN_BLOCK_CAP": 1024, "OUT_BLOCK_CAP": 1024},
    "blocks 256": {"IN_BLOCK_CAP": 256, "OUT_BLOCK_CAP": 256},
    "expand chunk 16": {"EXPAND_CHUNK": 16},
    "expand chunk 32": {"EXPAND_CHUNK": 32},
    "3 stages": {"NUM_STAGES": 3},
}


@dataclasses.dataclass(frozen=True)
class Plan:
    model: str  # preset whose q_proj (hidden -> hidden) is the kernels' shape
    dtype: str
    batch_sizes: tuple[int, ...]
    uniform_ranks: tuple[int, ...]
    mixed_ranks: tuple[tuple[int, ...], ...]  # rank patterns the rows cycle through
    prefill_tokens: tuple[int, ...]
    prefill_segments: tuple[int, ...]
    prefill_ranks: tuple[int, ...]
    copy_mib: int
    weight_mib: int  # adapter rows in the layers one loop cycles through, at least
    min_iters: int  # kernel calls per timed run, at least
    repeats: int  # timed runs, after one untimed


FULL = Plan(
    "llama2-7b", "bfloat16", (1, 2, 4, 8, 16, 32, 64), (8, 16, 32, 64, 128), MIXED_RANKS,
    (128, 512, 2048), (1, 8), (16, 64), copy_mib=1024, weight_mib=256, min_iters=50, repeats=5,
)  # fmt: skip
QUICK = Plan(
    "smollm2-135m", "float32", (1, 4, 16), (8, 32), MIXED_RANKS,
    (128,), (1, 8), (16,), copy_mib=64, weight_mib=0, min_iters=10, repeats=3,
)  # fmt: skip


@dataclasses.dataclass
class Measurement:
    kernel: str  # "bgmv", "mbgmv" or "sgmv"
    rows: int  # decode batch |S|, or prefill tokens T
    ranks: str  # label of the rows' ranks
    max_rank: int
    sum_ranks: int  # over rows (decode) or over segments (prefill)
    segments: int  # prefill only; 0 for decode
    bytes_moved: int  # per call, by the formulas in the module docstring
    flops: int  # per call: 2 · (rank rows applied) · (in + out), padding not counted
    seconds: list[float]  # per call, one per timed run

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)

    @property
    def median_us(self) -> float:
        return self.median_s * 1e6

    @property
    def bytes_per_s(self) -> float:
        return self.bytes_moved / self.median_s


# -- layouts --------------------------------------------------------------------


def random_rows(key: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """Normal entries scaled by 1/sqrt(last dim), drawn on the device (no host copy)."""
    return jax.random.normal(key, shape, dtype) * jnp.asarray(shape[-1] ** -0.5, dtype)


def rank_dim(ranks: Sequence[int]) -> int:
    return 1 << (max(ranks) - 1).bit_length()


def stacked(key: jax.Array, ranks: Sequence[int], layers: int, fan: int, dtype: Any):
    """BGMV slots a, b [L, N, R, fan]: slot n holds ranks[n] rank rows (the rest unused)."""
    shape = (layers, len(ranks), rank_dim(ranks), fan)
    return tuple(random_rows(half, shape, dtype) for half in jax.random.split(key))


def pool(key: jax.Array, rng, ranks: Sequence[int], layers: int, fan: int, dtype: Any):
    """a_pool, b_pool [L, Σr, fan] and pages i32[N, R]: slot n owns ranks[n] pages
    scattered through the pool; its entries beyond its rank are any valid page."""
    num_pages = sum(ranks)
    order = rng.permutation(num_pages)
    pages = rng.integers(0, num_pages, (len(ranks), rank_dim(ranks)))
    for slot, (rank, end) in enumerate(zip(ranks, np.cumsum(ranks), strict=True)):
        pages[slot, :rank] = order[end - rank : end]
    a_pool, b_pool = (
        random_rows(half, (layers, num_pages, fan), dtype) for half in jax.random.split(key)
    )
    return a_pool, b_pool, jnp.asarray(pages, jnp.int32)


def layers_for(layer_bytes: int, plan: Plan) -> int:
    return max(1, -(-plan.weight_mib * 2**20 // layer_bytes))


def rank_label(pattern: Sequence[int]) -> str:
    """(128, 16, 8, 8, ...) -> "128,16,8x14"; a uniform batch -> its rank."""
    runs = [(rank, len(list(group))) for rank, group in itertools.groupby(pattern)]
    return ",".join(f"{rank}x{count}" if count > 1 else str(rank) for rank, count in runs)


# -- timing ---------------------------------------------------------------------


def interpret_mode() -> bool:
    """Pallas kernels compile for GPUs only; elsewhere they run in the interpreter."""
    return jax.default_backend() != "gpu"


@functools.partial(jax.jit, static_argnames=("kernel", "layers", "iters", "interpret"))
def repeated_calls(y, operands, *, kernel: Callable, layers: int, iters: int, interpret: bool):
    """`iters` calls y = kernel(y, *operands, layer) in one executable, call i on layer i % L."""
    return lax.fori_loop(
        0, iters, lambda i, y: kernel(y, *operands, i % layers, interpret=interpret), y
    )


def timed_runs(run: Callable[[], Any], repeats: int) -> list[float]:
    """Seconds of each of `repeats` runs, after one untimed run."""
    jax.block_until_ready(run())
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(run())
        seconds.append(time.perf_counter() - start)
    return seconds


def time_calls(kernel: Callable, y, operands, layers: int, plan: Plan) -> list[float]:
    """Seconds per kernel call, one per timed run."""
    iters = max(layers, plan.min_iters)
    run = functools.partial(
        repeated_calls, y, operands, kernel=kernel, layers=layers, iters=iters,
        interpret=interpret_mode(),
    )  # fmt: skip
    return [seconds / iters for seconds in timed_runs(run, plan.repeats)]


def copy_bandwidth(plan: Plan) -> float:
    """Bytes/s of a jitted `jnp.copy` of `copy_mib` MiB (each byte read and written)."""
    source = jnp.ones(plan.copy_mib * 2**20 // 4, jnp.float32)
    copy = functools.partial(jax.jit(jnp.copy), source)
    return 2 * source.nbytes / statistics.median(timed_runs(copy, 2 * plan.repeats))


# -- the runs -------------------------------------------------------------------


def decode_batches(plan: Plan) -> list[tuple[str, tuple[int, ...]]]:
    """(label, each row's rank) for every decode batch of the plan."""
    batches = []
    for size in plan.batch_sizes:
        batches += [(str(rank), (rank,) * size) for rank in plan.uniform_ranks]
        for pattern in plan.mixed_ranks:
            if size % len(pattern) == 0:
                batches.append((rank_label(pattern), pattern * (size // len(pattern))))
    return batches


def measure_decode(
    plan: Plan, fan: int, dtype: Any, key, rng, batches: list | None = None
) -> list[Measurement]:
    """BGMV then MBGMV on every decode batch (the plan's, or `batches`), on the same x,
    y, idx and ranks."""
    itemsize = jnp.dtype(dtype).itemsize
    results = []
    for label, ranks in decode_batches(plan) if batches is None else batches:
        rows = len(ranks)
        print(f"  decode |S|={rows} ranks {label}", file=sys.stderr, flush=True)
        key, key_x, key_y, key_bgmv, key_mbgmv = jax.random.split(key, 5)
        x, y = random_rows(key_x, (rows, fan), dtype), random_rows(key_y, (rows, fan), dtype)
        idx, slot_ranks = jnp.arange(rows, dtype=jnp.int32), jnp.asarray(ranks, jnp.int32)
        for name, read_rows in (("bgmv", rows * max(ranks)), ("mbgmv", sum(ranks))):
            layer_bytes = read_rows * 2 * fan * itemsize
            layers = layers_for(layer_bytes, plan)
            if name == "bgmv":
                a, b = stacked(key_bgmv, ranks, layers, fan, dtype)
                seconds = time_calls(bgmv, y, (x, a, b, idx, slot_ranks), layers, plan)
            else:
                a, b, pages = pool(key_mbgmv, rng, ranks, layers, fan, dtype)
                seconds = time_calls(mbgmv, y, (x, a, b, idx, pages, slot_ranks), layers, plan)
            results.append(
                Measurement(
                    kernel=name, rows=rows, ranks=label, max_rank=max(ranks),
                    sum_ranks=sum(ranks), segments=0,
                    bytes_moved=layer_bytes + rows * 3 * fan * itemsize,
                    flops=2 * sum(ranks) * 2 * fan, seconds=seconds,
                )
            )  # fmt: skip
    return results


def measure_prefill(plan: Plan, fan: int, dtype: Any, key, rng) -> list[Measurement]:
    """SGMV on T tokens in G equal segments, segment g on slot g."""
    itemsize = jnp.dtype(dtype).itemsize
    results = []
    for tokens, segments, rank in itertools.product(
        plan.prefill_tokens, plan.prefill_segments, plan.prefill_ranks
    ):
        print(f"  prefill T={tokens} G={segments} r={rank}", file=sys.stderr, flush=True)
        key, key_x, key_y, key_pool = jax.random.split(key, 4)
        ranks = (rank,) * segments
        layer_bytes = segments * rank * 2 * fan * itemsize
        layers = layers_for(layer_bytes, plan)
        a_pool, b_pool, pages = pool(key_pool, rng, ranks, layers, fan, dtype)
        seg_slot = jnp.arange(segments, dtype=jnp.int32)
        seg_start = jnp.asarray(np.linspace(0, tokens, segments + 1), jnp.int32)
        x, y = random_rows(key_x, (tokens, fan), dtype), random_rows(key_y, (tokens, fan), dtype)
        operands = (x, a_pool, b_pool, seg_slot, seg_start, pages, jnp.asarray(ranks, jnp.int32))
        results.append(
            Measurement(
                kernel="sgmv", rows=tokens, ranks=str(rank), max_rank=rank,
                sum_ranks=sum(ranks), segments=segments,
                bytes_moved=layer_bytes + tokens * 3 * fan * itemsize,
                flops=2 * tokens * rank * 2 * fan,
                seconds=time_calls(sgmv, y, operands, layers, plan),
            )
        )  # fmt: skip
    return results


def tune(plan: Plan, fan: int, dtype: Any, key, rng) -> list[dict[str, Any]]:
    """Every TUNE_VARIANTS setting on the TUNE_RANKS batches at the plan's largest |S|
    (the defaults restored after); a row per variant, kernel and batch."""
    size = max(plan.batch_sizes)
    batches = [(rank_label(p), p * (size // len(p))) for p in TUNE_RANKS if size % len(p) == 0]
    modules = (common, bgmv_kernel, mbgmv_kernel)
    rows = []
    for variant, settings in TUNE_VARIANTS.items():
        print(f"tuning: {variant}", file=sys.stderr, flush=True)
        changed = [(mod, name) for mod in modules for name in settings if hasattr(mod, name)]
        defaults = {(mod, name): getattr(mod, name) for mod, name in changed}
        try:
            for mod, name in changed:
                setattr(mod, name, settings[name])
            jax.clear_caches()  # the kernels are traced again with the settings
            for m in measure_decode(plan, fan, dtype, key, rng, batches):
                rows.append({"variant": variant, **dataclasses.asdict(m), "median_s": m.median_s})
        finally:
            for (mod, name), value in defaults.items():
                setattr(mod, name, value)
            jax.clear_caches()
    return rows


def render_tuning(rows: list[dict[str, Any]], copy_bps: float) -> str:
    lines = table(
        ["variant", "kernel", "batch", "ranks", "µs", "of copy"],
        [
            [r["variant"], r["kernel"], r["rows"], r["ranks"], f"{1e6 * r['median_s']:.1f}",
             f"{r['bytes_moved'] / r['median_s'] / copy_bps:.0%}"]
            for r in rows
        ],
    )  # fmt: skip
    return "\n".join(["Tuning (decode kernels; each variant recompiles every kernel):", "", *lines])


# -- fits and report ------------------------------------------------------------


def fit_linear(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float]:
    """Least squares ys ≈ alpha · xs + beta -> (alpha, beta, R²)."""
    x, y = np.asarray(xs, np.float64), np.asarray(ys, np.float64)
    (alpha, beta), *_ = np.linalg.lstsq(np.stack([x, np.ones_like(x)], axis=1), y, rcond=None)
    total = float(np.sum((y - y.mean()) ** 2))
    residual = float(np.sum((y - alpha * x - beta) ** 2))
    return float(alpha), float(beta), 1.0 - residual / total if total > 0 else 1.0


MODELS = {"|S|·max r": lambda m: m.rows * m.max_rank, "Σr": lambda m: m.sum_ranks}
PAPER_MODEL = {"bgmv": "|S|·max r", "mbgmv": "Σr"}


def fits(measurements: list[Measurement]) -> list[dict[str, Any]]:
    """Each decode kernel's time (µs) against both models; `paper` marks CaraServe's."""
    rows = []
    for kernel, paper in PAPER_MODEL.items():
        points = [m for m in measurements if m.kernel == kernel]
        times = [m.median_us for m in points]
        for model, abscissa in MODELS.items():
            alpha, beta, r2 = fit_linear([abscissa(m) for m in points], times)
            fit = {"alpha_us": alpha, "beta_us": beta, "r2": r2, "points": len(points)}
            rows.append({"kernel": kernel, "model": model, "paper": model == paper, **fit})
    return rows


def machine_facts(plan: Plan, fan: int) -> dict[str, Any]:
    return {
        **report.machine_facts(),
        "interpret": interpret_mode(),
        "shape": f"{plan.model} q_proj {fan} -> {fan}, {plan.dtype}",
    }


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    """Markdown lines, `|` in cells escaped; the first column left-aligned, the rest right."""
    lines = [list(header), ["---"] + ["---:"] * (len(header) - 1), *rows]
    return [
        "| " + " | ".join(str(cell).replace("|", "\\|") for cell in line) + " |" for line in lines
    ]


def render(facts, copy_bps: float, measurements: list[Measurement], fitted) -> str:
    decode = [m for m in measurements if m.kernel in PAPER_MODEL]
    decode_rows = []
    for pair in zip(decode[::2], decode[1::2], strict=True):  # (bgmv, mbgmv) per batch
        max_over_mean = pair[0].rows * pair[0].max_rank / pair[0].sum_ranks
        row: list[object] = [pair[0].rows, pair[0].ranks, f"{max_over_mean:.0f}"]
        for m in pair:
            share = m.bytes_per_s / copy_bps
            row += [f"{m.median_us:.1f}", f"{m.bytes_per_s / 1e9:.1f}", f"{share:.0%}"]
        decode_rows.append(row)
    fit_rows = [
        [fit["kernel"].upper(), f"x = {fit['model']}" + (" (paper)" if fit["paper"] else ""),
         f"{fit['alpha_us']:.4f}", f"{fit['beta_us']:.1f}", f"{fit['r2']:.3f}", fit["points"]]
        for fit in fitted
    ]  # fmt: skip
    prefill_rows = [
        [m.rows, m.segments, m.ranks, f"{m.median_us:.1f}", f"{m.flops / m.median_s / 1e9:.1f}"]
        for m in measurements
        if m.kernel == "sgmv"
    ]
    per_kernel = [f"{k} {c}" for k in ("BGMV", "MBGMV") for c in ("µs", "GB/s", "of copy")]
    lines = [
        f"LoRA kernels | {facts['shape']} | {facts['device']} ({facts['jax_backend']}) | "
        f"jax {facts['jax']} | {facts['date']}",
        "",
        *(["**interpret mode on CPU: not a bandwidth figure**", ""] if facts["interpret"] else []),
        f"device-to-device copy (`jnp.copy`): {copy_bps / 1e9:.1f} GB/s (read + write)",
        "",
        *table(["batch", "ranks", "max/mean", *per_kernel], decode_rows),
        "",
        *table(
            ["kernel", "time = α · x + β", "α (µs per row·rank)", "β (µs)", "R²", "points"],
            fit_rows,
        ),
        "",
        *table(["SGMV tokens", "segments", "rank", "µs", "GFLOP/s"], prefill_rows),
        "",
        "Times are medians per kernel call. Bytes: BGMV |S|·max r·(in+out), MBGMV Σr·(in+out) "
        "adapter rows, plus x, y in and out; 'of copy' = achieved bytes/s over copy bytes/s.",
    ]
    return "\n".join(lines)


def write_report(
    path: Path, facts, plan: Plan, copy_bps: float, measurements, fitted, tuning
) -> None:
    results = [
        {**dataclasses.asdict(m), "median_s": m.median_s, "bytes_per_s": m.bytes_per_s}
        for m in measurements
    ]
    report.write_report(
        path, facts, plan, results, copy_bytes_per_s=copy_bps, fits=fitted, tuning=tuning
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, fewer points")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write raw results here")
    parser.add_argument("--markdown", type=Path, metavar="PATH", help="also write the tables here")
    parser.add_argument(
        "--batches", help="decode batch sizes, comma-separated (default: the plan's)"
    )
    parser.add_argument("--ranks", help="uniform ranks, comma-separated (default: the plan's)")
    parser.add_argument(
        "--tune", action="store_true", help="also time TUNE_VARIANTS' kernel settings"
    )
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    if args.batches:
        plan = dataclasses.replace(plan, batch_sizes=tuple(int(n) for n in args.batches.split(",")))
    if args.ranks:
        plan = dataclasses.replace(plan, uniform_ranks=tuple(int(n) for n in args.ranks.split(",")))
    if interpret_mode() and not args.quick:
        print("no GPU: the full plan in interpret mode takes hours (try --quick)", file=sys.stderr)

    fan = load_preset(plan.model).config.hidden_size
    dtype = jnp.dtype(plan.dtype)
    facts = machine_facts(plan, fan)
    key, rng = jax.random.key(0), np.random.default_rng(0)
    print(f"copy bandwidth, then kernels ({facts['shape']})...", file=sys.stderr, flush=True)
    copy_bps = copy_bandwidth(plan)
    measurements = measure_decode(plan, fan, dtype, key, rng)
    measurements += measure_prefill(plan, fan, dtype, jax.random.fold_in(key, 1), rng)
    fitted = fits(measurements)
    tuning = tune(plan, fan, dtype, jax.random.fold_in(key, 2), rng) if args.tune else []

    report = render(facts, copy_bps, measurements, fitted)
    if tuning:
        report += "\n\n" + render_tuning(tuning, copy_bps)
    print(report)
    if args.markdown:
        args.markdown.write_text(report + "\n")
    if args.json:
        write_report(args.json, facts, plan, copy_bps, measurements, fitted, tuning)


if __name__ == "__main__":
    main()
