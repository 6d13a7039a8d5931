"""Where a decode step's time goes: `jax.profiler` traces of decode steps, summarised.

Run: `python -m bench.step_profile [--model llama2-7b --dtype bfloat16] [--batch 32]
[--adapters 0,32] [--backend bgmv] [--targets q_proj,k_proj,v_proj,o_proj]
[--slot-targets adapters|all] [--steps 16]
[--variants stacked,...] [--markdown PATH] [--json PATH] [--trace-dir DIR]`
(`tools/gpu_check.sh OUT profile` runs it on a GPU). On a GPU it answers what
`bench.lora_decode` cannot: whether a step's time is the device computing, the device
copying, or the device idle while the host launches and schedules.

The decode of `bench.lora_decode` (B prompts of 64 tokens, greedy, EOS ignored, every
adapter resident), for systems in one process on the same loaded model: `no-lora`
(an engine with no LoRA code) and `BACKEND k=K` for each K of `--adapters` (a LoRA
engine, rows spread over K distinct rank-16 adapters; k=0: the same engine, no row with
an adapter, which tells the LoRA code's own cost from the adapters'). Each runs once
untimed, once timed, and once with its decode steps (not the step that prefills) under
the profiler. Reported per step, from the trace:

- `wall`: the timed run's seconds per step (host scheduling included);
- `busy`: the union of the device's kernel intervals, so `wall - busy` is time the
  device waited for the host (on a CPU, of the XLA thread pools' events, which miss
  much of the work: read the CPU's columns as a smoke test, not a profile);
- `kernels`: kernels launched (on a CPU, thunks run);
- the ops (XLA's names, with the shape each produces where the trace says) and the
  kernels (the GPU's) that took the most device time, by name without their numeric
  suffixes (`fusion.12` and `fusion.40` are both `fusion`), with their launches per
  step.

`--variants` builds both systems once per way of reading each layer's weights:

- `stacked`: a `lax.scan` slicing layer i out of the stacked arrays (`--layer-loop scan`);
- `copies`: every layer's parameters copied into arrays of their own (on a GPU, 2x the
  weights' memory), picked by a `lax.switch` on i: what the CPU does without a copy
  (`jlora/model/host/layer_views.py`);
- `unrolled`: the layer loop unrolled in Python (`--layer-loop unrolled`, the GPU's
  default), so each layer's slices of the stack are static;
- `copies-unrolled`: both: each layer's own arrays, picked without a switch.

XLA flags (`--xla_gpu_enable_command_buffer=...`, dynamic-slice fusion) are read once
per process: run the bench once per setting, with XLA_FLAGS set
(`tools/gpu_check.sh OUT profile` does).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import glob
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import jax
from jax.profiler import ProfileData

from bench.lib.engines import SLOT_TARGETS, Plan, System, make_engine, spread
from bench.lib.report import machine_facts, write_report
from bench.lib.timing import jlora_decode, make_prompts
from jlora.adapters.peft import make_demo_adapters
from jlora.cli.common import names_from, target_list
from jlora.device.steps import CompiledSteps
from jlora.model.host import layer_views
from jlora.model.loading import load_model

TOP = 16  # ops listed per system
SUFFIX = re.compile(r"[._]\d+$")
OUTPUT_SHAPE = re.compile(r"= *(\w+\[[\d,]*\])")  # "%fusion.3 = bf16[4096,4096]{1,0} fusion(..."


@dataclasses.dataclass
class StepProfile:
    system: str
    steps: int
    wall_ms: float  # per step, untraced
    busy_ms: float  # per step: the union of device (or XLA thread) intervals
    kernels: float  # per step
    ops: list[tuple[str, float, float]]  # (name, ms per step, launches per step), by time
    kernel_ops: list[tuple[str, float, float]]  # the same, by kernel name
    lines: list[str]  # the trace's lines these came from


def _device_lines(data: ProfileData) -> tuple[list, list]:
    """(kernel lines, op lines): a GPU's stream lines and its `XLA Ops` line; on a CPU,
    the XLA thread pools' lines for both."""
    devices = [plane for plane in data.planes if plane.name.startswith("/device:")]
    if devices:
        lines = [line for plane in devices for line in plane.lines]
        kernels = [line for line in lines if line.name.startswith("Stream")] or [
            line for line in lines if not line.name.startswith(("XLA", "Launch", "Steps"))
        ]
        ops = [line for line in lines if line.name == "XLA Ops"]
        return kernels, ops or kernels
    host = [plane for plane in data.planes if plane.name == "/host:CPU"]
    lines = [line for plane in host for line in plane.lines if line.name.startswith("tf_XLA")]
    return lines, lines


def _union_ns(intervals: Iterable[tuple[float, float]]) -> float:
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _key(event: Any) -> str:
    """An event's name without its numeric suffix and, where the trace gives the HLO
    instruction (a GPU's `XLA Ops`: the `long_name` stat), the shape it produces: the
    same fusion over different arrays is told apart."""
    name = SUFFIX.sub("", event.name)[:80]
    for stat, value in event.stats:
        if stat == "long_name" and (shape := OUTPUT_SHAPE.search(str(value))):
            return f"{name} {shape.group(1)}"
    return name


def top(lines: list, steps: int) -> list[tuple[str, float, float]]:
    """The TOP names by time on these lines: (name, ms per step, events per step)."""
    by_name: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for line in lines:
        for event in line.events:
            if event.duration_ns > 0:
                entry = by_name[_key(event)]
                entry[0] += event.duration_ns
                entry[1] += 1
    ranked = sorted(
        ((name, ns / 1e6 / steps, count / steps) for name, (ns, count) in by_name.items()),
        key=lambda op: -op[1],
    )
    return ranked[:TOP]


def summarise(data: ProfileData, steps: int) -> dict:
    """busy ms, kernels, top ops and top kernels per step, from a trace of `steps` steps."""
    kernel_lines, op_lines = _device_lines(data)
    events = [e for line in kernel_lines for e in line.events if e.duration_ns > 0]
    return {
        "lines": sorted({line.name for line in kernel_lines + op_lines}),
        "busy_ms": _union_ns((e.start_ns, e.end_ns) for e in events) / 1e6 / steps,
        "kernels": len(events) / steps,
        "ops": top(op_lines, steps),
        "kernel_ops": top(kernel_lines, steps),
    }


def profile(system: str, run: Callable[..., float], steps: int, directory: Path) -> StepProfile:
    """Run once untimed, once timed, once with the decode steps under the profiler."""
    run()  # untimed: compiles the shapes the run meets (the engines warm up on demand)
    wall = run() / steps
    directory.mkdir(parents=True, exist_ok=True)
    run(around=lambda: jax.profiler.trace(str(directory)))
    (path,) = glob.glob(str(directory / "**" / "*.xplane.pb"), recursive=True)
    summary = summarise(ProfileData.from_file(path), steps)
    return StepProfile(system, steps, wall * 1e3, **summary)


@contextlib.contextmanager
def layer_copies() -> Iterator[None]:
    """Engines made and run inside decode with every layer's parameters in arrays of
    their own, copied where they cannot be views (a GPU's)."""
    steps_init, split = CompiledSteps.__init__, layer_views.split_layers

    def split_or_copy(stacked: jax.Array) -> list[jax.Array]:
        return split(stacked) or [stacked[i] for i in range(stacked.shape[0])]

    CompiledSteps.__init__ = functools.partialmethod(steps_init, layer_views=True)  # type: ignore[method-assign,assignment]
    layer_views.split_layers = split_or_copy
    try:
        yield
    finally:
        CompiledSteps.__init__ = steps_init  # type: ignore[method-assign]
        layer_views.split_layers = split


# Each variant: the engines' EngineConfig.layer_loop, and whether they decode with
# per-layer copies of the parameters.
VARIANTS: dict[str, tuple[str, Callable[[], contextlib.AbstractContextManager]]] = {
    "stacked": ("scan", contextlib.nullcontext),
    "copies": ("scan", layer_copies),
    "unrolled": ("unrolled", contextlib.nullcontext),
    "copies-unrolled": ("unrolled", layer_copies),
}


def _slots(plan: Plan) -> str:
    return "all seven projections" if plan.slot_targets == ("all",) else "the adapters' targets"


def render(facts: dict, plan: Plan, profiles: list[StepProfile]) -> str:
    lines = [
        f"{plan.model} {plan.dtype} | {facts['device']} | jax {facts['jax']} "
        f"({facts['jax_backend']}) | {facts['date']} | "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}",
        "",
        f"decode, batch {plan.batch}, prompts of {plan.prompt_len} tokens, "
        f"{plan.new_tokens} steps traced; adapters of rank {plan.rank} on "
        f"{', '.join(plan.targets)}; slots on {_slots(plan)}",
        "",
        "| system | wall ms/step | device busy ms/step | idle ms/step | kernels/step |",
        "|---|---:|---:|---:|---:|",
    ]
    for p in profiles:
        lines.append(
            f"| {p.system} | {p.wall_ms:.2f} | {p.busy_ms:.2f} | "
            f"{p.wall_ms - p.busy_ms:.2f} | {p.kernels:.0f} |"
        )
    for p in profiles:
        for what, ops in (("ops", p.ops), ("kernels", p.kernel_ops)):
            lines += ["", f"{p.system}: top {what}", "", "| name | ms/step | launches/step |"]
            lines.append("|---|---:|---:|")
            lines += [f"| `{name}` | {ms:.3f} | {n:.0f} |" for name, ms, n in ops]
    return "\n".join(lines)


def write(args: argparse.Namespace, facts: dict, plan: Plan, profiles: list[StepProfile]) -> None:
    if args.markdown:
        args.markdown.write_text(render(facts, plan, profiles) + "\n")
    if args.json:
        report = [dataclasses.asdict(p) for p in profiles]
        xla_flags = os.environ.get("XLA_FLAGS", "")
        write_report(args.json, facts, plan, report, xla_flags=xla_flags)


def _counts(text: str) -> tuple[int, ...]:
    """An argparse type: comma-separated adapter counts K >= 0, at least one above 0."""
    try:
        counts = tuple(int(k) for k in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not comma-separated integers: {text!r}") from None
    if min(counts) < 0 or max(counts) < 1:
        raise argparse.ArgumentTypeError(f"counts must be >= 0, one of them >= 1: {text!r}")
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama2-7b", help="a preset (default %(default)s)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument(
        "--adapters",
        type=_counts,
        default="32",
        help="distinct adapters K of each LoRA system, comma-separated (0: none in the batch)",
    )
    parser.add_argument("--backend", default="bgmv")
    parser.add_argument("--targets", type=target_list, default="q_proj,k_proj,v_proj,o_proj")
    parser.add_argument(
        "--slot-targets",
        choices=SLOT_TARGETS,
        default=SLOT_TARGETS[0],
        help="the LoRA engines' slots: the adapters' targets (default) or all seven",
    )
    parser.add_argument("--steps", type=int, default=16, help="decode steps per run")
    parser.add_argument("--markdown", type=Path, metavar="PATH")
    parser.add_argument("--json", type=Path, metavar="PATH")
    parser.add_argument(
        "--trace-dir", type=Path, metavar="DIR", help="keep the traces here (else they are deleted)"
    )
    parser.add_argument(
        "--variants",
        type=names_from(VARIANTS),
        default="stacked",
        help=f"comma-separated, of {list(VARIANTS)}",
    )
    args = parser.parse_args(argv)
    plan = Plan(
        model=args.model,
        dtype=args.dtype,
        batch=args.batch,
        new_tokens=args.steps,
        adapter_counts=args.adapters,
        targets=args.targets,
        backends=(args.backend,),
        slot_targets=(args.slot_targets,),
    )
    facts = machine_facts()
    print("loading the model, writing adapters, compiling...", file=sys.stderr, flush=True)
    loaded = load_model(plan.model, plan.dtype)
    prompts = make_prompts(loaded, plan.batch, plan.prompt_len)
    profiles: list[StepProfile] = []
    with tempfile.TemporaryDirectory() as tmp:
        traces = args.trace_dir or Path(tmp, "traces")
        paths = make_demo_adapters(
            loaded.config,
            tmp,
            n=max(args.adapters),
            ranks=[plan.rank],
            targets=plan.targets,
            seed=0,
        )
        adapters = {path.name: path for path in paths}
        lora = System(args.backend, args.backend, slot_targets=args.slot_targets)
        systems = [("no-lora", 0, False)]
        systems += [(f"{args.backend} k={k}", k, True) for k in args.adapters]
        for variant in args.variants:  # one engine at a time, the tables rewritten after each
            for system, count, with_adapters in systems:
                name = system if variant == "stacked" else f"{system}, {variant}"
                print(f"profiling {name}...", file=sys.stderr, flush=True)
                layer_loop, copies = VARIANTS[variant]
                with copies():
                    engine = make_engine(  # what the untimed run meets compiles then
                        loaded,
                        plan,
                        adapters if with_adapters else {},
                        lora,
                        on_demand=True,
                        layer_loop=layer_loop,
                    )
                    rows = spread(list(adapters), count, plan.batch)
                    run = functools.partial(jlora_decode, engine, prompts, plan.new_tokens, rows)
                    trace_dir = traces / re.sub(r"\W+", "_", name)
                    profiles.append(profile(name, run, plan.new_tokens, trace_dir))
                    engine.close()
                write(args, facts, plan, profiles)
    print(render(facts, plan, profiles))


if __name__ == "__main__":
    main()
