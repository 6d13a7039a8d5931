"""Host memory of a checkpoint load: the peak resident set while jlora reads a sharded
bf16 Hugging Face checkpoint into bf16, against the serving weights' bytes (issue 57).

Run: `python -m bench.load_memory [--quick]` (`make bench-load-memory`; Llama 3.2 1B's
shapes, 1.24 billion parameters, about 2 minutes and 5 GB of disk on two cores;
`--quick` a 0.1 billion model). Writes `bench/results/<date>-cpu-load-memory.md` and
`.json`.

The checkpoint is random bf16 tensors in Hugging Face's names and layout, in shards of
at most `shard_mb` with `model.safetensors.index.json`, as `save_pretrained` writes a
big model. Each load runs in a fresh process: after importing jlora and starting JAX's
CPU client it records its resident set (the baseline), then loads, then reads the
kernel's high-water mark of its resident set (`VmHWM`) and the resident set left. On the
CPU the device's copy of the weights lives in host memory too, so the load's rise above
the baseline includes the weights themselves: the goal is a rise of at most 1.3x the
serving-dtype weights (the weights, plus what a load holds beside them at its peak), and
the table records the 1-minute load average, which moves the seconds, not the bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np

from bench.lib.report import dated_stem, machine_facts, write_report

RESULTS = Path(__file__).parent / "results"
GOAL = 1.3


@dataclasses.dataclass(frozen=True)
class Plan:
    vocab_size: int = 128256  # Llama 3.2 1B
    hidden_size: int = 2048
    intermediate_size: int = 8192
    num_layers: int = 16
    num_heads: int = 32
    num_kv_heads: int = 8
    tie_embeddings: bool = True
    shard_mb: float = 1000
    repeats: int = 2


QUICK = dataclasses.replace(
    Plan(), vocab_size=32000, hidden_size=768, intermediate_size=2048, num_layers=8,
    num_heads=12, num_kv_heads=4, shard_mb=100, repeats=1,
)  # fmt: skip


def tensor_shapes(plan: Plan) -> dict[str, tuple[int, ...]]:
    """Hugging Face Llama's tensors ([out, in] linear weights) for the plan's shapes."""
    head_dim = plan.hidden_size // plan.num_heads
    q, kv = plan.num_heads * head_dim, plan.num_kv_heads * head_dim
    h, f = plan.hidden_size, plan.intermediate_size
    shapes = {"model.embed_tokens.weight": (plan.vocab_size, h), "model.norm.weight": (h,)}
    if not plan.tie_embeddings:
        shapes["lm_head.weight"] = (plan.vocab_size, h)
    for i in range(plan.num_layers):
        prefix = f"model.layers.{i}"
        shapes |= {
            f"{prefix}.input_layernorm.weight": (h,),
            f"{prefix}.post_attention_layernorm.weight": (h,),
            f"{prefix}.self_attn.q_proj.weight": (q, h),
            f"{prefix}.self_attn.k_proj.weight": (kv, h),
            f"{prefix}.self_attn.v_proj.weight": (kv, h),
            f"{prefix}.self_attn.o_proj.weight": (h, q),
            f"{prefix}.mlp.gate_proj.weight": (f, h),
            f"{prefix}.mlp.up_proj.weight": (f, h),
            f"{prefix}.mlp.down_proj.weight": (h, f),
        }
    return shapes


def write_checkpoint(plan: Plan, path: Path) -> int:
    """A random bf16 checkpoint in shards with its index; its weights' bytes."""
    from safetensors.numpy import save_file

    shapes = tensor_shapes(plan)
    rng = np.random.default_rng(0)
    limit = int(plan.shard_mb * 10**6)
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = 2 * int(np.prod(shape))
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    weight_map = {}
    for n, names in enumerate(shards, 1):
        file = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        tensors = {
            name: (0.02 * rng.standard_normal(shapes[name], np.float32)).astype(ml_dtypes.bfloat16)
            for name in names
        }
        save_file(tensors, str(path / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(names, file)
        del tensors
    total = sum(2 * int(np.prod(shape)) for shape in shapes.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "vocab_size": plan.vocab_size, "hidden_size": plan.hidden_size,
        "intermediate_size": plan.intermediate_size, "num_hidden_layers": plan.num_layers,
        "num_attention_heads": plan.num_heads, "num_key_value_heads": plan.num_kv_heads,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
        "tie_word_embeddings": plan.tie_embeddings, "torch_dtype": "bfloat16",
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0,
                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192},
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    return total


# The child: the resident set (kB) before and at the peak of one load, and its seconds.
CHILD = """
import json, sys, time
from pathlib import Path

import jax, jax.numpy as jnp
from jlora.model.loading import load_model

def status(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])

jnp.zeros(1).block_until_ready()
baseline = status("VmRSS")
start = time.perf_counter()
loaded = load_model(sys.argv[1], jnp.bfloat16)
jax.block_until_ready(loaded.params)
seconds = time.perf_counter() - start
weights = sum(leaf.nbytes for leaf in jax.tree.leaves(loaded.params))
dtypes = sorted({str(leaf.dtype) for leaf in jax.tree.leaves(loaded.params)})
print(json.dumps({"baseline_kb": baseline, "peak_kb": status("VmHWM"),
                  "after_kb": status("VmRSS"), "seconds": seconds,
                  "weights_bytes": weights, "dtypes": dtypes}))
"""


def measure(path: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(path)],
        capture_output=True, text=True, check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )  # fmt: skip
    result = json.loads(out.stdout.strip().splitlines()[-1])
    rise = (result["peak_kb"] - result["baseline_kb"]) * 1024
    return {**result, "rise_bytes": rise, "ratio": rise / result["weights_bytes"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 0.1 billion parameter model")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else Plan()
    facts = machine_facts()
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        total = write_checkpoint(plan, Path(tmp))
        written_s = time.perf_counter() - start
        shards = len(list(Path(tmp).glob("model-*.safetensors")))
        runs = [measure(Path(tmp)) for _ in range(plan.repeats)]
    params = total // 2
    lines = [
        "# Host memory of a sharded bf16 checkpoint load",
        "",
        f"{params / 1e9:.2f} billion parameters (Llama 3.2 1B's shapes"
        f"{'' if plan == Plan() else ', reduced'}) in {shards} bf16 safetensors shards "
        f"({total / 1e9:.2f} GB), served in bf16 | {facts['cpu_count']} CPUs "
        f"({facts['cpu_model']}) | jax {facts['jax']} | {facts['date']} | 1-min load avg "
        f"{facts['load_avg_1min_start']:.1f}",
        "",
        "| Run | Baseline RSS | Peak RSS | Rise | Weights (bf16) | Rise / weights | Load s |",
        "|---|---|---|---|---|---|---|",
    ]
    for n, run in enumerate(runs, 1):
        lines.append(
            f"| {n} | {run['baseline_kb'] / 2**20:.2f} GiB | {run['peak_kb'] / 2**20:.2f} GiB | "
            f"{run['rise_bytes'] / 2**30:.2f} GiB | {run['weights_bytes'] / 2**30:.2f} GiB | "
            f"{run['ratio']:.3f}x | {run['seconds']:.1f} |"
        )
    worst = max(run["ratio"] for run in runs)
    lines += [
        "",
        f"Goal: rise <= {GOAL}x the serving weights; worst run {worst:.3f}x: "
        f"**{'met' if worst <= GOAL else 'not met'}**. The parameters load as "
        f"{', '.join(runs[0]['dtypes'])}; writing the checkpoint took {written_s:.0f} s.",
        "",
        "The rise is measured from after JAX's CPU client starts to the kernel's high-water "
        "mark of the process's resident set. On the CPU the device's memory is the host's: "
        "the default device adopts each parameter's aligned host buffer as assembled, so "
        "the rise is the weights once plus one layer's tensor as read. On a GPU the host "
        "holds at most one parameter's stack across the layers beside that tensor.",
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    stem = dated_stem(args.out, "cpu-load-memory")
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    write_report(args.out / f"{stem}.json", facts, plan, runs, total_bytes=total, shards=shards)
    print("\n".join(lines))
    return 0 if worst <= GOAL else 1


if __name__ == "__main__":
    sys.exit(main())
