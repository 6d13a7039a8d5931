"""Checks that need a multi-device mesh, run in a process of their own with fake CPU
devices (`XLA_FLAGS=--xla_force_host_platform_device_count=N` must be set before jax
loads, and the test session has loaded it already): tests/test_sharding.py runs

    python -m tests.sharded_checks CASE [CASE ...]

and reads one JSON object per case from stdout. A case is `kind:arg:arg...`:

- `tokens:MODEL:PRESET:SCHEME:BACKEND:MODE`: greedy tokens of a mixed batch (base rows
  and three adapters of different ranks and target sets, two device slots, so loads
  and evictions happen) on the sharded engine and on a single-device one;
- `memory:MODEL:PRESET:SCHEME`: each device's bytes of every parameter, of the KV
  cache and of the adapter slots, and the whole arrays' bytes;
- `hlo:MODEL:PRESET:SCHEME`: the collectives in the compiled decode step, with and
  without LoRA;
- `restore:MODEL:PRESET:SOURCE`: a `jlora convert` checkpoint (SOURCE `checkpoint`) or
  a Hugging Face directory (`hf`) loaded straight into the mesh's layout: each
  parameter's spec and per-device bytes as loaded, and the greedy tokens of an engine
  over it next to the single-device ones;
- `packed:MODEL:PRESET:SCHEME:BACKEND`: four prompts of two adapters and the base model
  in one packed prefill (`prefill_many`) on the mesh, and one prefill each on one
  device: each prompt's greedy tokens;
- `transfer:MODEL:PRESET:SCHEME:BACKEND`: the rank-exact transfer of the all-target
  adapter (rank 12) on the mesh and on one device: the bytes each sent, each device's
  part of the landed A and B of q_proj and o_proj, and whether the installed slots are
  the same bit for bit;
- `merge:MODEL:PRESET:SCHEME`: merged inference (dLoRA) of the all-target adapter, on
  the mesh and on one device: greedy tokens of the base model, and of the adapter
  unmerged and merged, each merged kernel's
  spec next to its base kernel's, the largest difference between the two engines'
  merged kernels, and whether unmerging put every parameter back bit for bit.
"""

from __future__ import annotations

import functools
import json
import re
import sys
import tempfile
from pathlib import Path

import numpy as np

ADAPTERS = (  # rank, targets: different ranks and target sets
    (4, ("q_proj", "v_proj")),
    (12, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    (32, ("o_proj", "gate_proj", "up_proj", "down_proj")),
)
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


TINY_X3 = "tiny-x3"  # cpu-tiny widened so that three devices divide it (6 heads, 3 KV heads)
# Llama 3's attention in small: 16 heads over 8 KV heads, llama3 RoPE scaling (acting past
# 16 positions); with every bias (Qwen2's q/k/v, Llama's attention_bias and mlp_bias)
# drawn non-zero, so that a bias split or added on the wrong side of the reduce shows.
TINY_GQA8 = "tiny-gqa8"
LLAMA3_ROPE = dict(type="llama3", factor=8.0, original_max_position_embeddings=16)


@functools.cache
def _load(model: str):
    """A model preset, or TINY_X3 / TINY_GQA8 (random weights)."""
    import dataclasses

    import jax

    from configs import load_preset
    from jlora.model.llama import Llama
    from jlora.model.loading import LoadedModel, load_model

    widened = {
        TINY_X3: dict(hidden_size=96, intermediate_size=192, num_heads=6, num_kv_heads=3),
        TINY_GQA8: dict(
            hidden_size=128, intermediate_size=192, num_heads=16, num_kv_heads=8,
            rope_theta=5e5, rope_scaling=LLAMA3_ROPE, qkv_bias=True, o_bias=True,
            mlp_bias=True,
        ),
    }  # fmt: skip
    if model not in widened:
        return load_model(model)
    config = dataclasses.replace(load_preset("cpu-tiny").config, name=model, **widened[model])
    params = Llama(config).init_params(0)
    if model == TINY_GQA8:  # kernels of std 0.2 (not 0.02), so that attention matters
        keys = iter(jax.random.split(jax.random.PRNGKey(1), 16))
        for leaves in params["layers"].values():
            if "kernel" in leaves:
                leaves["kernel"] = 10 * leaves["kernel"]
            if "bias" in leaves:
                leaves["bias"] = 0.5 * jax.random.normal(next(keys), leaves["bias"].shape)
    return LoadedModel(config, params, None, model)


def _sharding(preset: str, scheme: str):
    from configs import load_sharding

    return load_sharding(preset).with_lora_sharding(scheme)


def _adapters(config, root: Path) -> dict[str, Path]:
    from jlora.adapters.peft import make_demo_adapters

    paths = {}
    for i, (rank, targets) in enumerate(ADAPTERS):
        (path,) = make_demo_adapters(
            config, root / f"a{i}", n=1, ranks=[rank], targets=targets, seed=20 + i
        )
        paths[f"a{i}-r{rank}"] = path
    return paths


def _engine(loaded, adapters, **config):
    from tests.engine_helpers import make_engine

    engine = make_engine(
        loaded, max_slots=4, max_seq_len=128, min_bucket=16, max_loras=2, max_lora_rank=32,
        lora_layer_groups=2, **config,
    )  # fmt: skip
    for name, path in adapters.items():
        engine.register_adapter(name, path)
    return engine


def tokens(model: str, preset: str, scheme: str, backend: str, mode: str) -> dict:
    single = _greedy(model, backend, None)
    sharded = _greedy(model, backend, (preset, scheme, mode))
    return {
        "single": single["tokens"],
        "sharded": sharded["tokens"],
        **{f"sharded_{key}": sharded[key] for key in ("loads", "evictions", "assisted")},
    }


@functools.cache
def _greedy(model: str, backend: str, sharded: tuple[str, str, str] | None) -> dict:
    """The mixed batch's greedy tokens and the engine's counters, on the mesh of
    `sharded` (preset, LoRA scheme, lora_mode) or on one device (None: computed once
    for all the cases of a model and backend)."""
    from jlora.engine.api import SamplingParams
    from tests.engine_helpers import run_to_completion

    loaded = _load(model)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, loaded.config.vocab_size, n).tolist() for n in (5, 17, 9, 30, 12)]
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    config: dict = {"lora_backend": backend}
    if sharded is not None:
        preset, scheme, mode = sharded
        config |= {
            "sharding": _sharding(preset, scheme),
            "lora_mode": mode,
            "cpu_workers": 1,
            "emulated_link_gbps": 2e-4 if mode == "cpu-assist" else 0.0,
        }
    with tempfile.TemporaryDirectory() as tmp:
        adapters = _adapters(loaded.config, Path(tmp))
        names = list(adapters)
        rows = [names[0], None, names[1], names[2], names[0]]
        engine = _engine(loaded, adapters, **config)
        try:
            out = run_to_completion(engine, prompts, greedy, rows)
            stats = engine.stats()
            return {
                "tokens": [r["token_ids"] for r in out],
                "loads": stats.adapter_loads,
                "evictions": stats.adapter_evictions,
                "assisted": engine.counters["assisted_prefills"],
            }
        finally:
            engine.close()


def transfer(model: str, preset: str, scheme: str, backend: str) -> dict:
    import jax

    loaded, result, slots = _load(model), {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        adapters = _adapters(loaded.config, Path(tmp))
        name = list(adapters)[1]
        for where, config in (("single", {}), ("sharded", {"sharding": _sharding(preset, scheme)})):
            # Slots on one device too (a mesh keeps its own), so the two layouts compare.
            engine = _engine(loaded, adapters, lora_backend=backend, lora_pool="slots", **config)
            try:
                device = engine.device
                landing = device.load_adapter(name, 0)
                result[f"{where}_bytes"] = landing.nbytes
                first = landing.landed[0]
                result[f"{where}_parts"] = {
                    f"{target}.{part}": sorted(
                        {
                            tuple(shard.data.shape)
                            for shard in first[target][part].addressable_shards
                        }
                    )
                    for target in ("q_proj", "o_proj")
                    for part in ("a", "b")
                }
                device.install_adapter(name, 0, landing)
                slots[where] = [np.asarray(leaf) for leaf in jax.tree.leaves(device.lora.weights)]
            finally:
                engine.close()
    result["equal"] = all(
        np.array_equal(a, b) for a, b in zip(slots["single"], slots["sharded"], strict=True)
    )
    return result


def memory(model: str, preset: str, scheme: str) -> dict:
    import jax

    from configs import EngineConfig
    from jlora.device.llama_engine import LlamaEngine
    from jlora.model.loading import load_model
    from jlora.model.sharding import per_device_bytes

    loaded = load_model(model)
    config = EngineConfig(
        max_slots=2, max_seq_len=64, min_bucket=16, max_loras=2, max_lora_rank=16,
        sharding=_sharding(preset, scheme),
    )  # fmt: skip
    engine = LlamaEngine(
        model_config=loaded.config, params=loaded.params, tokenizer=None, engine_config=config
    )
    try:

        def describe(tree) -> dict:
            flat = jax.tree_util.tree_flatten_with_path(tree)[0]
            return {
                jax.tree_util.keystr(path): {
                    "whole": int(leaf.nbytes),
                    "per_device": sorted(per_device_bytes(leaf).values()),
                    "spec": str(leaf.sharding.spec),
                }
                for path, leaf in flat
            }

        return {
            "params": describe(engine.params),
            "cache": describe(engine.cache),
            "lora": describe(engine.lora.weights),
            "devices": len(engine.mesh.devices.flat),
        }
    finally:
        engine.close()


def hlo(model: str, preset: str, scheme: str) -> dict:
    from configs import EngineConfig
    from jlora.device.llama_engine import LlamaEngine
    from jlora.model.loading import load_model

    loaded = load_model(model)
    counts = {}
    for label, loras in (("base", 0), ("lora", 2)):
        config = EngineConfig(
            max_slots=4, max_seq_len=64, min_bucket=16, max_loras=loras, max_lora_rank=8,
            sharding=_sharding(preset, scheme),
        )  # fmt: skip
        engine = LlamaEngine(
            model_config=loaded.config, params=loaded.params, tokenizer=None, engine_config=config
        )
        try:
            state, weights = engine.rows.state, None if engine.lora is None else engine.lora.weights
            text = (
                engine.steps._decode_jit.lower(
                    engine.params,
                    engine.cache,
                    state.tokens,
                    state.positions,
                    state.block_tables[:, :4],
                    state.sampling,
                    weights,
                    None if weights is None else state.lora_idx,
                )  # fmt: skip
                .compile()
                .as_text()
            )
        finally:
            engine.close()
        counts[label] = {op: len(re.findall(rf"\b{op}(?:-start)?\(", text)) for op in COLLECTIVES}
    return counts


def _save_hf(loaded, path: Path) -> None:
    """The model as a Hugging Face Llama directory (config.json, model.safetensors)."""
    from safetensors.numpy import save_file

    from jlora.model.weights import LAYER_MODULES, LEAVES

    config = loaded.config
    assert config.qkv_bias == config.o_bias, "Hugging Face's attention_bias is both"
    hf = dict(
        model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=config.vocab_size,
        hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim,
        rope_theta=config.rope_theta,
        rms_norm_eps=config.rms_norm_eps, max_position_embeddings=config.max_context,
        tie_word_embeddings=config.tie_embeddings, attention_bias=config.o_bias,
        mlp_bias=config.mlp_bias,
        rope_scaling=config.rope_scaling and {
            "rope_type": config.rope_scaling.type, "factor": config.rope_scaling.factor,
            "low_freq_factor": config.rope_scaling.low_freq_factor,
            "high_freq_factor": config.rope_scaling.high_freq_factor,
            "original_max_position_embeddings":
                config.rope_scaling.original_max_position_embeddings,
        },
    )  # fmt: skip
    params = loaded.params
    tensors = {
        "model.embed_tokens.weight": np.asarray(params["embed"]["embedding"]),
        "model.norm.weight": np.asarray(params["final_norm"]["scale"]),
    }
    if "lm_head" in params:
        tensors["lm_head.weight"] = np.ascontiguousarray(np.asarray(params["lm_head"]["kernel"]).T)
    for module, leaves in params["layers"].items():
        for leaf, stacked in leaves.items():
            suffix, transposed = LEAVES[leaf]
            for i, array in enumerate(np.asarray(stacked)):
                name = f"model.layers.{i}.{LAYER_MODULES[module]}.{suffix}"
                tensors[name] = np.ascontiguousarray(array.T if transposed else array)
    path.mkdir()
    (path / "config.json").write_text(json.dumps(hf))
    save_file(tensors, str(path / "model.safetensors"))


def restore(model: str, preset: str, source: str) -> dict:
    """`source`: "checkpoint" (`jlora convert`'s orbax) or "hf" (a Hugging Face
    directory's safetensors)."""
    import jax

    from configs import load_sharding
    from jlora.engine.api import SamplingParams
    from jlora.model.checkpoint import save_checkpoint
    from jlora.model.loading import load_model
    from jlora.model.sharding import per_device_bytes
    from tests.engine_helpers import make_engine, run_to_completion

    loaded = _load(model)
    prompts = [[5, 9, 2, 77], [400, 3, 3, 12, 8, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        stored = Path(tmp) / source
        if source == "checkpoint":
            save_checkpoint(stored, loaded.config, loaded.params, None, model)
        else:
            _save_hf(loaded, stored)
        sharding = load_sharding(preset)
        restored = load_model(str(stored), sharding=sharding)
        flat = jax.tree_util.tree_flatten_with_path(restored.params)[0]
        layout = {
            jax.tree_util.keystr(path): {
                "spec": str(leaf.sharding.spec),
                "per_device": sorted(per_device_bytes(leaf).values()),
                "whole": int(leaf.nbytes),
            }
            for path, leaf in flat
        }
        results = {"layout": layout}
        for label, source, config in (
            ("single", loaded, {}),
            ("sharded", restored, {"sharding": sharding}),
        ):
            engine = make_engine(source, max_slots=2, max_seq_len=64, min_bucket=16, **config)
            try:
                results[label] = [
                    r["token_ids"] for r in run_to_completion(engine, prompts, greedy)
                ]
            finally:
                engine.close()
    return results


def packed(model: str, preset: str, scheme: str, backend: str) -> dict:
    from configs import EngineConfig
    from jlora.device.llama_engine import LlamaEngine
    from tests.test_packed_prefill import ADAPTERS as SLOTS
    from tests.test_packed_prefill import _Blocks, continue_greedy

    loaded = _load(model)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        adapters = _adapters(loaded.config, Path(tmp))
        for label, sharding in (("single", None), ("sharded", _sharding(preset, scheme))):
            config = EngineConfig(
                max_slots=4, max_seq_len=256, min_bucket=16, max_loras=2, max_lora_rank=32,
                lora_backend=backend, sharding=sharding,
            )  # fmt: skip
            device = LlamaEngine(
                model_config=loaded.config, params=loaded.params, tokenizer=None,
                engine_config=config,
            )  # fmt: skip
            try:
                for slot, name in zip(SLOTS.values(), list(adapters)[1:], strict=True):
                    device.stage_adapter(name, str(adapters[name]))
                    device.install_adapter(name, slot, device.load_adapter(name, slot))
                jobs = _Blocks(device).jobs()
                results[label] = continue_greedy(device, jobs, packed=label == "sharded")
            finally:
                device.close()
    return results


def merge(model: str, preset: str, scheme: str) -> dict:
    import jax

    from configs import EngineConfig
    from jlora.device.llama_engine import LlamaEngine
    from tests.test_merge import drive

    loaded = _load(model)
    prompts = [[5, 9, 2, 77], [400, 3, 3, 12, 8]]
    results: dict = {}
    merged_kernels = {}
    with tempfile.TemporaryDirectory() as tmp:
        adapters = _adapters(loaded.config, Path(tmp))
        name = next(name for name in adapters if "r12" in name)  # all seven targets
        for label, sharding in (("single", None), ("sharded", _sharding(preset, scheme))):
            config = EngineConfig(
                max_slots=2, max_seq_len=32, min_bucket=16, max_loras=1, max_lora_rank=16,
                merge="always", sharding=sharding,
            )  # fmt: skip
            device = LlamaEngine(
                model_config=loaded.config,
                params=loaded.params,
                tokenizer=None,
                engine_config=config,
            )
            try:
                device.stage_adapter(name, str(adapters[name]))
                device.install_adapter(name, 0, device.load_adapter(name, 0))
                before = [np.asarray(leaf) for leaf in jax.tree.leaves(device.params)]
                unmerged = drive(device, prompts, [0, 0], 8)
                base_tokens = drive(device, prompts, [-1, -1], 8)
                device.merge(name)
                layers, base = device.params["layers"], device.base_params["layers"]
                specs = {  # the targets merged: [base kernel's spec, merged kernel's]
                    target: [str(tree[target]["kernel"].sharding.spec) for tree in (base, layers)]
                    for target in layers
                    if layers[target] is not base[target]
                }
                kernels = {target: np.asarray(layers[target]["kernel"]) for target in specs}
                merged = drive(device, prompts, [0, 0], 8)
                device.unmerge()
                after = [np.asarray(leaf) for leaf in jax.tree.leaves(device.params)]
            finally:
                device.close()
            if label == "sharded":  # the single-device k/v as wide as the mesh's
                widen = device.tp.expand_kv
                for target in ("k_proj", "v_proj"):
                    merged_kernels["single"][target] = widen(merged_kernels["single"][target])
            merged_kernels[label] = kernels
            results[label] = {
                "base": base_tokens,
                "unmerged": unmerged,
                "merged": merged,
                "specs": specs,
                "restored": len(before) == len(after)
                and all(np.array_equal(b, a) for b, a in zip(before, after, strict=True)),
            }
    single, sharded = merged_kernels["single"], merged_kernels["sharded"]
    results["max_diff"] = max(float(np.abs(single[t] - sharded[t]).max()) for t in single)
    return results


def main(cases: list[str]) -> None:
    for case in cases:
        kind, *args = case.split(":")
        kinds = {"tokens": tokens, "memory": memory, "hlo": hlo, "restore": restore}
        kinds |= {"merge": merge, "packed": packed, "transfer": transfer}
        result = kinds[kind](*args)
        print(json.dumps({"case": case, "result": result}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
