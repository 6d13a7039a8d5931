"""PEFT LoRA adapter directories against a base model: their tensors read and checked,
adapters written, and demo adapters made.

The directory's format, its config and its tensor names are `jlora.contract.peft`'s
(which the router reads too). Loading turns each target's lora_A/lora_B into
layer-stacked `A [L, in, rank]` and `B [L, rank, out]` with the scaling folded into B,
so the delta is `x @ A[l] @ B[l]`. Every check runs before a `PeftAdapter` is returned;
a tensor that does not fit the base model (a different shape, dtype, or non-finite
values) is refused with an `AdapterError` that names the path and the tensor.

No jax here: the host store and the CPU workers read these arrays with numpy.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from configs import ModelConfig
from jlora.contract.adapters import CONFIG_FILE, WEIGHTS_FILE, Adapter
from jlora.contract.peft import (
    AdapterError,
    adapter_config,
    canonical_targets,
    check_ranks,
    check_tensor_names,
    read_adapter_config,
    read_safetensors,
    tensor_key,
)
from jlora.model.lora.targets import TARGETS, target_shapes

# The standard deviation of a demo adapter's B entries, times sqrt(rank); see
# make_demo_adapters.
_DEMO_B_STD = 0.1


@dataclasses.dataclass(frozen=True)
class PeftAdapter:
    """A validated adapter, ready for the host store.

    Semantics: for layer l and target t, `delta = x @ weights[t][0][l] @ weights[t][1][l]`
    is added to the output of the base projection t (scaling already folded into B).

    adapter: its record, with its file's sha256 and size.
    weights: target -> (A f32[num_layers, in, rank], B f32[num_layers, rank, out]), for
        `adapter.targets` only, with in/out from `target_shapes(config)`.
    """

    adapter: Adapter
    weights: dict[str, tuple[np.ndarray, np.ndarray]]

    @property
    def num_layers(self) -> int:
        return next(iter(self.weights.values()))[0].shape[0]


def load_peft_adapter(path: str | Path, config: ModelConfig) -> PeftAdapter:
    """Read, validate and convert the PEFT adapter at `path` for the base model `config`.

    The tensors must be exactly lora_A/lora_B of every layer of `config` for each target
    in `target_modules`, shaped [r, in] and [out, r] (in/out of the base projection),
    F32, F16 or BF16, and finite. The result holds float32 copies in jlora's layout.
    """
    spec = read_adapter_config(path)
    directory = Path(path)
    file = directory / WEIGHTS_FILE
    tensors, sha256, nbytes = read_safetensors(directory)
    check_tensor_names(file, spec, tensors, config.num_layers)
    shapes = target_shapes(config)
    weights = {}
    for target in spec.targets:
        in_features, out_features = shapes[target]
        stacked_a = np.empty((config.num_layers, in_features, spec.rank), np.float32)
        stacked_b = np.empty((config.num_layers, spec.rank, out_features), np.float32)
        for layer in range(config.num_layers):
            for factor, expected, out in (
                ("A", (spec.rank, in_features), stacked_a),
                ("B", (out_features, spec.rank), stacked_b),
            ):
                key = tensor_key(layer, target, factor)
                array = _to_float32(file, key, tensors[key], expected, config)
                out[layer] = array.T
        stacked_b *= np.float32(spec.scaling)
        weights[target] = (stacked_a, stacked_b)
    return PeftAdapter(dataclasses.replace(spec, sha256=sha256, size_bytes=nbytes), weights)


def write_peft_adapter(
    out_dir: str | Path,
    spec: Adapter,
    weights_peft_layout: dict[str, tuple[np.ndarray, np.ndarray]],
) -> Path:
    """Write a PEFT adapter directory that `PeftModel.from_pretrained` loads as is: the
    config of `spec` (its rank, alpha, use_rslora, targets, base_model; its name and path
    are not written).

    weights_peft_layout: target -> (A [L, rank, in], B [L, out, rank]), unscaled, exactly
    `spec.targets`; saved as float32. `out_dir` must not exist or be empty.
    """
    directory = Path(out_dir)
    if set(weights_peft_layout) != set(spec.targets):
        raise AdapterError(
            f"weights for {sorted(weights_peft_layout)} do not match the spec's targets "
            f"{list(spec.targets)}"
        )
    for target, (lora_a, lora_b) in weights_peft_layout.items():
        if lora_a.ndim != 3 or lora_b.ndim != 3:
            raise AdapterError(f"weights[{target!r}]: A and B must be [L, rank, in], [L, out, r]")
        if lora_a.shape[1] != spec.rank or lora_b.shape[2] != spec.rank:
            raise AdapterError(
                f"weights[{target!r}]: A {lora_a.shape} and B {lora_b.shape} do not have "
                f"rank {spec.rank}"
            )
    num_layers = {stacked.shape[0] for pair in weights_peft_layout.values() for stacked in pair}
    if len(num_layers) != 1 or 0 in num_layers:
        raise AdapterError(
            f"weights: layer counts {sorted(num_layers)} must be one positive number"
        )
    tensors = {}
    for target, (lora_a, lora_b) in weights_peft_layout.items():
        for layer in range(lora_a.shape[0]):
            for factor, stacked in (("A", lora_a), ("B", lora_b)):
                key = tensor_key(layer, target, factor)
                tensors[key] = np.ascontiguousarray(stacked[layer], np.float32)
    _check_empty_or_absent(directory)

    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_FILE).write_text(json.dumps(adapter_config(spec), indent=2) + "\n")
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    return directory


def make_demo_adapters(
    config: ModelConfig,
    out_dir: str | Path,
    *,
    n: int,
    ranks: Sequence[int],
    targets: Iterable[str] = TARGETS,
    seed: int = 0,
    base_model: str | None = None,
) -> list[Path]:
    """Write `n` random adapters for `config` as `out_dir/demo-{i:02d}-r{rank}`.

    Ranks cycle through `ranks`; lora_alpha = 2 * rank (scaling 2). Adapter i draws from
    `default_rng([seed, i])`, so it does not depend on `n`. Unlike PEFT's initialisation
    (B = 0), both factors are non-zero: these are the "dummy weights" that serving papers
    benchmark with, and they must visibly change the output.

    Scale: A ~ N(0, 1/in) keeps x @ A at x's RMS; B ~ N(0, 0.1 / sqrt(rank)) then makes
    the delta's RMS 2 * 0.1 * rms(x) = 0.2 * rms(x), whatever the rank. Measured on
    SmolLM2 (PEFT on transformers, fp32, all 7 targets, ranks 8/16/32/64, four short
    prompts, 40 greedy tokens): at 0.05, 2 of the 16 (adapter, prompt) continuations were
    unchanged; at 0.1 all 16 changed, the first differing token at position 0 to 24
    (median 5), no token repeated more than twice in a row, the text fluent (one
    continuation repeats a sentence, as the base model does on another prompt); at 0.2
    four fell into loops ("The answer is:" over and over, "778.778.778").
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise AdapterError(f"n={n!r}: the number of adapters must be a positive integer")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise AdapterError(f"seed={seed!r}: must be a non-negative integer")
    ranks = check_ranks(ranks)
    targets = canonical_targets(targets)
    root = Path(out_dir)
    plan = [(f"demo-{i:02d}-r{ranks[i % len(ranks)]}", ranks[i % len(ranks)]) for i in range(n)]
    for name, _ in plan:
        _check_empty_or_absent(root / name)
    shapes = target_shapes(config)
    paths = []
    for i, (name, rank) in enumerate(plan):
        rng = np.random.default_rng([seed, i])
        weights = {}
        for target in targets:
            in_features, out_features = shapes[target]
            lora_a = rng.normal(
                0.0, 1.0 / math.sqrt(in_features), (config.num_layers, rank, in_features)
            )
            lora_b = rng.normal(
                0.0, _DEMO_B_STD / math.sqrt(rank), (config.num_layers, out_features, rank)
            )
            weights[target] = (lora_a, lora_b)
        spec = Adapter(rank=rank, alpha=2.0 * rank, targets=targets, base_model=base_model)
        paths.append(write_peft_adapter(root / name, spec, weights))
    return paths


# -- helpers ---------------------------------------------------------------------------


def _check_empty_or_absent(directory: Path) -> None:
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise AdapterError(f"{directory} exists and is not an empty directory; not overwriting")


def _to_float32(
    file: Path, key: str, tensor: dict[str, Any], expected: tuple[int, int], config: ModelConfig
) -> np.ndarray:
    """One deserialized tensor as a float32 [rows, cols] array, after its checks."""
    shape = tuple(tensor["shape"])
    if shape != expected:
        rank_axis = 0 if key.endswith("lora_A.weight") else 1
        if len(shape) == 2 and shape[rank_axis] != expected[rank_axis]:
            reason = f"its rank does not match r={expected[rank_axis]} in {CONFIG_FILE}"
        else:
            reason = f"the adapter was made for a different base model than {config.name}"
        raise AdapterError(f"{file}: tensor {key} has shape {shape}, expected {expected}: {reason}")
    dtype = tensor["dtype"]
    raw = tensor["data"]
    if dtype == "F32":
        array = np.frombuffer(raw, np.float32)
    elif dtype == "F16":
        array = np.frombuffer(raw, np.float16).astype(np.float32)
    elif dtype == "BF16":
        # bfloat16 is the top half of a float32: widen the bits, no ml_dtypes needed.
        array = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:
        raise AdapterError(f"{file}: tensor {key} has dtype {dtype}; expected F32, F16 or BF16")
    if not np.isfinite(array).all():
        raise AdapterError(f"{file}: tensor {key} has non-finite values (NaN or inf)")
    return array.reshape(shape)
