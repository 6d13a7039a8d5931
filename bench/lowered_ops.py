"""What the LoRA path adds to a GPU decode step, counted without a GPU: the step lowered
for CUDA on the CPU, per layer.

Run: `python -m bench.lowered_ops [--models llama2-7b,llama3-8b] [--rows 32]
[--slots 32] [--rank 16] [--targets q_proj,k_proj,v_proj,o_proj] [--json PATH]
[--markdown PATH]` (a minute on 2 cores).

For each model, the decode step's body (`Llama.decode`: the embedding, the layers
unrolled as a GPU engine runs them, the logits; the sampler, the same for every
variant, left out) at `rows` rows attending over 1024 tokens, in bfloat16, traced over
`jax.ShapeDtypeStruct`s (no weights in memory) and lowered with
`lower(lowering_platforms=("cuda",))`, so the Pallas kernels lower to their Triton
custom calls as on a GPU. Variants: the base model, and the LoRA engine's step with
each backend (BGMV, MBGMV) over `slots` device slots of rank `rank` on `targets` (the
slots hold only those, as the engine's do); and the base step with the decode-attention
kernel in place of XLA's (`decode_attention="pallas"`). The LoRA engine's step with no adapter row
is the base model's step itself: the engine runs its steps without LoRA for such a call
(`LlamaEngine._steps_for`), so it adds nothing, by construction.

Counts are of StableHLO operations by name in the whole module, a custom call by its
target and a Triton kernel by its name. The LoRA path's ops = the LoRA step's counts
minus the base step's; every one lies inside a layer, so each kind's difference is
checked to divide by the layer count, and is reported per layer. This is a proxy for
launches: XLA fuses the elementwise ones, but not the custom calls, and every
reduction, transpose and gather costs a kernel or a fusion of its own.
"""

from __future__ import annotations

import argparse
import collections
import re
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from bench.lib.report import emit, machine_facts
from configs.model import load_preset
from jlora.model.kv_cache import KVCache
from jlora.model.llama import Llama
from jlora.model.lora.pallas import BgmvBackend, MbgmvBackend
from jlora.model.lora.targets import target_shapes

BACKENDS = {"bgmv": BgmvBackend, "mbgmv": MbgmvBackend}
CONTEXT = 1024  # tokens each row attends over
BLOCK = 16
_FUNC = re.compile(r"^\s*func\.func (?:public |private )?@([\w$.]+)\(")
_CALL = re.compile(r"(?:^\s*|= )(?:func\.)?call @([\w$.]+)\(")
_OP = re.compile(r'^\s*(?:%[\w#:, ]+ = )?"?([a-z_]+\.[a-z_0-9.]+)"?')
_TARGET = re.compile(r"stablehlo\.custom_call @([\w$.]+)")
_KERNEL = re.compile(r'name = "(\w+)", num_stages')


def op_counts(text: str) -> collections.Counter[str]:
    """The operations `@main` of StableHLO text runs, by name (custom calls by target,
    Triton kernels by name), each called function's counted once per call."""
    own: dict[str, collections.Counter[str]] = {}
    callees: dict[str, list[str]] = {}
    function = None
    for line in text.splitlines():
        if match := _FUNC.match(line):
            function = match.group(1)
            own[function], callees[function] = collections.Counter(), []
            continue
        if function is None:
            continue
        if match := _CALL.search(line):
            callees[function].append(match.group(1))
            continue
        match = _OP.match(line)
        if match is None or match.group(1) in ("func.return", "stablehlo.return"):
            continue
        name = match.group(1)
        if name == "stablehlo.custom_call":
            target, kernel = _TARGET.search(line), _KERNEL.search(line)
            name = f"triton:{kernel.group(1)}" if kernel else f"custom_call:{target.group(1)}"
        own[function][name.removeprefix("stablehlo.")] += 1

    def total(name: str) -> collections.Counter[str]:
        counts = collections.Counter(own[name])
        for callee in callees[name]:
            counts.update(total(callee))
        return counts

    return total("main")


def lowered_decode(
    preset: str,
    backend: str | None,
    *,
    rows: int,
    slots: int,
    rank: int,
    targets: tuple[str, ...],
    decode_attention: str = "xla",
) -> str:
    """The StableHLO text of `preset`'s decode step lowered for CUDA (see the docstring)."""
    config = load_preset(preset).config
    lora = None if backend is None else BACKENDS[backend](interpret=False)
    model = Llama(
        config,
        jnp.bfloat16,
        lora=lora,
        unroll_layers=True,
        decode_attention=decode_attention,
        interpret_kernels=False,
    )
    blocks = CONTEXT // BLOCK
    cache = jax.eval_shape(
        lambda: KVCache.zeros(
            num_layers=config.num_layers,
            num_blocks=rows * blocks,
            block_size=BLOCK,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            dtype=jnp.bfloat16,
        )
    )
    i32 = jnp.int32
    inputs: list[Any] = [
        model.param_shapes(),
        cache,
        jax.ShapeDtypeStruct((rows,), i32),  # tokens
        jax.ShapeDtypeStruct((rows,), i32),  # positions
        jax.ShapeDtypeStruct((rows, blocks), i32),  # block tables
    ]
    if lora is not None:
        shapes = {t: s for t, s in target_shapes(config).items() if t in targets}
        inputs.append(
            jax.eval_shape(
                lambda: lora.allocate(
                    num_layers=config.num_layers,
                    num_slots=slots,
                    max_rank=rank,
                    shapes=shapes,
                    dtype=jnp.bfloat16,
                )
            )
        )
        inputs.append(jax.ShapeDtypeStruct((rows,), i32))  # each row's slot
    traced = jax.jit(model.decode).trace(*inputs)
    return traced.lower(lowering_platforms=("cuda",)).as_text()


def measure(preset: str, args: argparse.Namespace) -> dict[str, Any]:
    """The base step's counts and each backend's added ops per layer."""
    layers = load_preset(preset).config.num_layers
    options = dict(rows=args.rows, slots=args.slots, rank=args.rank, targets=args.targets)
    start = time.perf_counter()
    base = op_counts(lowered_decode(preset, None, **options))
    result: dict[str, Any] = {
        "model": preset,
        "layers": layers,
        "base_total": sum(base.values()),
        "base": dict(sorted(base.items())),
        "added_per_layer": {"no adapter row": {}},
    }
    for name in BACKENDS:
        counts = op_counts(lowered_decode(preset, name, **options))
        added = {op: counts[op] - base[op] for op in counts | base if counts[op] != base[op]}
        uneven = {op: n for op, n in added.items() if n % layers}
        if uneven:
            raise AssertionError(f"{preset} {name}: ops added outside the layers: {uneven}")
        result["added_per_layer"][name] = {op: n // layers for op, n in sorted(added.items())}
    kernel = op_counts(lowered_decode(preset, None, **options, decode_attention="pallas"))
    result["attention_kernel_per_layer"] = {
        op: (kernel[op] - base[op]) / layers
        for op in sorted(kernel | base)
        if kernel[op] != base[op]
    }
    result["lowering_s"] = round(time.perf_counter() - start, 1)
    return result


def markdown(results: list[dict[str, Any]], args: argparse.Namespace, facts: dict) -> str:
    lines = [
        f"# The LoRA path's ops in a decode step lowered for CUDA ({facts['date'][:10]})",
        "",
        f"`python -m bench.lowered_ops` on {facts['cpu_count']} cores ({facts['cpu_model']}), "
        f"JAX {facts['jax']}: "
        f"{args.rows} rows over {CONTEXT} tokens, bfloat16, {args.slots} slots of rank "
        f"{args.rank} on {', '.join(args.targets)}, layers unrolled. Ops per layer that the "
        "LoRA path adds to the base step (StableHLO, before XLA's fusion; custom calls "
        "by target, Triton kernels by name).",
        "",
    ]
    for result in results:
        lines += [f"## {result['model']} ({result['layers']} layers)", ""]
        lines += [f"The base step: {result['base_total']} ops in all.", ""]
        kinds = sorted({op for added in result["added_per_layer"].values() for op in added})
        variants = list(result["added_per_layer"])
        lines.append("| op | " + " | ".join(variants) + " |")
        lines.append("|---|" + "---:|" * len(variants))
        for op in kinds:
            cells = [str(result["added_per_layer"][v].get(op, 0)) for v in variants]
            lines.append(f"| `{op}` | " + " | ".join(cells) + " |")
        totals = [str(sum(result["added_per_layer"][v].values())) for v in variants]
        lines += ["| **all** | " + " | ".join(totals) + " |", ""]
        changed = result["attention_kernel_per_layer"]
        lines += [
            'The base step with the decode-attention kernel (`decode_attention="pallas"`) '
            "against XLA's attention, ops per layer (negative: gone):",
            "",
            "| op | per layer |",
            "|---|---:|",
            *(f"| `{op}` | {n:+g} |" for op, n in changed.items()),
            f"| **all** | {sum(changed.values()):+g} |",
            "",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama2-7b,llama3-8b")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args(argv)
    args.targets = tuple(args.targets.split(","))
    facts = machine_facts()
    results = [measure(preset, args) for preset in args.models.split(",")]
    text = markdown(results, args, facts)
    emit(text, facts, results, json_path=args.json, markdown_path=args.markdown)


if __name__ == "__main__":
    main()
