"""PEFT LoRA adapter directories: read, validate, write, and make demo adapters.

A PEFT directory holds `adapter_config.json` and `adapter_model.safetensors`. The file
stores, for each layer `l` and target projection, two tensors in PyTorch Linear layout:

    base_model.model.model.layers.{l}.{self_attn|mlp}.{target}.lora_A.weight  [rank, in]
    base_model.model.model.layers.{l}.{self_attn|mlp}.{target}.lora_B.weight  [out, rank]

and PEFT computes `y = x @ W.T + scaling * (x @ lora_A.T) @ lora_B.T`. Loading turns
each target into layer-stacked `A [L, in, rank]` and `B [L, rank, out]` with the scaling
folded into B, so the delta is `x @ A[l] @ B[l]`. Every check runs before a
`PeftAdapter` is returned; anything jlora cannot serve exactly (DoRA, bias terms, whole
trained modules, per-module ranks, a different base shape) is refused with an
`AdapterError` that names the path and the field or tensor.

No jax here: the host store and the CPU workers read these arrays with numpy.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from configs import ModelConfig
from jlora.contract.adapters import CONFIG_FILE, WEIGHTS_FILE
from jlora.contract.errors import InvalidRequest
from jlora.model.lora.targets import MODULE_OF, TARGETS, target_shapes

# PEFT's tensor names inside adapter_model.safetensors (the adapter name is not stored).
_KEY = "base_model.model.model.layers.{layer}.{module}.{target}.lora_{factor}.weight"
_KEY_RE = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight"
)

# adapter_config.json fields that change the computation away from plain LoRA: refused
# unless absent or at PEFT's default. field -> (accepted values, why it is refused).
_UNSET: tuple[Any, ...] = (None, False, [], {})
_UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "use_dora": (_UNSET, "DoRA adapters are not supported"),
    "modules_to_save": (_UNSET, "adapters that train whole modules are not supported"),
    "bias": ((None, "none"), "bias terms are not supported"),
    "lora_bias": (_UNSET, "LoRA bias terms are not supported"),
    "fan_in_fan_out": (_UNSET, "transposed (Conv1D) weights are not supported"),
    "rank_pattern": (_UNSET, "per-module ranks are not supported"),
    "alpha_pattern": (_UNSET, "per-module alphas are not supported"),
    "layers_to_transform": (_UNSET, "adapters on a subset of layers are not supported"),
    "layers_pattern": (_UNSET, "adapters on a subset of layers are not supported"),
    "exclude_modules": (_UNSET, "excluded modules are not supported"),
    "layer_replication": (_UNSET, "layer replication is not supported"),
    "trainable_token_indices": (_UNSET, "trainable token embeddings are not supported"),
    "target_parameters": (_UNSET, "parameter (MoE) targets are not supported"),
    "alora_invocation_tokens": (_UNSET, "Activated LoRA (aLoRA) is not supported"),
    "use_qalora": (_UNSET, "QALoRA is not supported"),
    "use_bdlora": (_UNSET, "block-diagonal LoRA (BD-LoRA) is not supported"),
    "arrow_config": (_UNSET, "Arrow routing is not supported"),
}

# The standard deviation of a demo adapter's B entries, times sqrt(rank); see
# make_demo_adapters.
_DEMO_B_STD = 0.1


class AdapterError(InvalidRequest):
    """A bad adapter (or bad arguments for one); the message names the file and the
    entry at fault. As a request error its field is the adapter's `path`."""

    def __init__(self, message: str, *, field: str | None = "path") -> None:
        super().__init__(message, field=field)


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """The hyper-parameters of one LoRA adapter (PEFT's `LoraConfig`, the parts jlora uses).

    rank: PEFT's `r`. alpha: `lora_alpha`. targets: the adapted projections, normalised to
    the canonical `TARGETS` order. base_model: `base_model_name_or_path`, informational.
    """

    rank: int
    alpha: float
    use_rslora: bool
    targets: tuple[str, ...]
    base_model: str | None = None

    def __post_init__(self) -> None:
        _check_positive_int(self.rank, "LoraSpec.rank")
        _check_positive_number(self.alpha, "LoraSpec.alpha")
        object.__setattr__(self, "alpha", float(self.alpha))
        if not isinstance(self.use_rslora, bool):
            raise AdapterError(f"LoraSpec.use_rslora={self.use_rslora!r} must be a bool")
        object.__setattr__(self, "targets", canonical_targets(self.targets))

    @property
    def scaling(self) -> float:
        """PEFT's rule (peft 0.21, `peft/tuners/lora/layer.py`, `LoraLayer.update_layer`):
        lora_alpha / sqrt(r) with rank-stabilised LoRA (`use_rslora`), lora_alpha / r
        otherwise."""
        return self.alpha / math.sqrt(self.rank) if self.use_rslora else self.alpha / self.rank


@dataclasses.dataclass(frozen=True)
class PeftAdapter:
    """A validated adapter, ready for the host store.

    Semantics: for layer l and target t, `delta = x @ weights[t][0][l] @ weights[t][1][l]`
    is added to the output of the base projection t (scaling already folded into B).

    weights: target -> (A f32[num_layers, in, rank], B f32[num_layers, rank, out]), for
        `spec.targets` only, with in/out from `target_shapes(config)`.
    sha256, nbytes: of adapter_model.safetensors (the identity of the weights).
    """

    path: Path
    spec: LoraSpec
    sha256: str
    nbytes: int
    weights: dict[str, tuple[np.ndarray, np.ndarray]]

    @property
    def num_layers(self) -> int:
        return next(iter(self.weights.values()))[0].shape[0]


@dataclasses.dataclass(frozen=True)
class AdapterSummary:
    """What `inspect_peft_adapter` reads without a base model: num_layers comes from the
    tensor names, sha256 and nbytes from adapter_model.safetensors."""

    path: Path
    spec: LoraSpec
    sha256: str
    nbytes: int
    num_layers: int


def canonical_targets(names: Iterable[str]) -> tuple[str, ...]:
    """The target projections `names` denote, in `TARGETS` order, without repeats.

    Accepted: a projection name ("q_proj") or its module-qualified suffix
    ("self_attn.q_proj"), the two forms PEFT matches on every layer.
    """
    if isinstance(names, str):
        raise AdapterError(f"{names!r} is a string; expected a list of target module names")
    found = set()
    for name in names:
        target = name.rsplit(".", 1)[-1] if isinstance(name, str) else None
        if target not in MODULE_OF or name not in (target, f"{MODULE_OF[target]}.{target}"):
            raise AdapterError(
                f"target module {name!r} is not supported; supported: {', '.join(TARGETS)} "
                "(lm_head, embed_tokens, layer-specific names and regular expressions are not)"
            )
        found.add(target)
    if not found:
        raise AdapterError("no target modules")
    return tuple(t for t in TARGETS if t in found)


def check_ranks(ranks: Iterable[int]) -> tuple[int, ...]:
    """`ranks` as a non-empty tuple of positive ints, or AdapterError naming the bad one."""
    ranks = tuple(ranks)
    if not ranks:
        raise AdapterError("ranks: at least one rank is needed")
    for rank in ranks:
        _check_positive_int(rank, "rank")
    return ranks


def read_lora_spec(path: str | Path) -> LoraSpec:
    """Parse and validate `path/adapter_config.json` (no weights are read)."""
    directory = Path(path)
    if not directory.is_dir():
        what = "is not a directory" if directory.exists() else "does not exist"
        raise AdapterError(f"adapter {directory} {what} (expected a PEFT adapter directory)")
    file = directory / CONFIG_FILE
    if not file.is_file():
        raise AdapterError(f"{file} is missing: {directory} is not a PEFT adapter directory")
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise AdapterError(f"{file}: cannot read it as JSON ({err})") from err
    if not isinstance(data, dict):
        raise AdapterError(f"{file}: expected a JSON object, found {type(data).__name__}")
    try:
        return _spec_from_json(data)
    except AdapterError as err:
        raise AdapterError(f"{file}: {err}") from None


def load_peft_adapter(path: str | Path, config: ModelConfig) -> PeftAdapter:
    """Read, validate and convert the PEFT adapter at `path` for the base model `config`.

    The tensors must be exactly lora_A/lora_B of every layer of `config` for each target
    in `target_modules`, shaped [r, in] and [out, r] (in/out of the base projection),
    F32, F16 or BF16, and finite. The result holds float32 copies in jlora's layout.
    """
    spec = read_lora_spec(path)
    directory = Path(path)
    file = directory / WEIGHTS_FILE
    tensors, sha256, nbytes = _read_safetensors(directory)
    _check_tensor_names(file, spec, tensors, config.num_layers)
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
                key = _tensor_key(layer, target, factor)
                array = _to_float32(file, key, tensors[key], expected, config)
                out[layer] = array.T
        stacked_b *= np.float32(spec.scaling)
        weights[target] = (stacked_a, stacked_b)
    return PeftAdapter(directory, spec, sha256, nbytes, weights)


def inspect_peft_adapter(path: str | Path) -> AdapterSummary:
    """Read an adapter without a base model: its config, the file's hash and the layer
    count the tensor names imply; the names must be LoRA tensors of `target_modules` for
    every layer (shapes and values are only checked by `load_peft_adapter`)."""
    spec = read_lora_spec(path)
    directory = Path(path)
    tensors, sha256, nbytes = _read_safetensors(directory)
    file = directory / WEIGHTS_FILE
    layers = [int(m.group(1)) for m in map(_KEY_RE.fullmatch, tensors) if m]
    if not layers:
        raise AdapterError(f"{file}: no lora_A/lora_B tensors of decoder layers")
    _check_tensor_names(file, spec, tensors, max(layers) + 1)
    return AdapterSummary(directory, spec, sha256, nbytes, max(layers) + 1)


def write_peft_adapter(
    out_dir: str | Path,
    spec: LoraSpec,
    weights_peft_layout: dict[str, tuple[np.ndarray, np.ndarray]],
) -> Path:
    """Write a PEFT adapter directory that `PeftModel.from_pretrained` loads as is.

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
                key = _tensor_key(layer, target, factor)
                tensors[key] = np.ascontiguousarray(stacked[layer], np.float32)
    _check_empty_or_absent(directory)

    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_FILE).write_text(json.dumps(_spec_to_json(spec), indent=2) + "\n")
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
        spec = LoraSpec(rank, 2.0 * rank, False, targets, base_model)
        paths.append(write_peft_adapter(root / name, spec, weights))
    return paths


# -- helpers ---------------------------------------------------------------------------


def _check_empty_or_absent(directory: Path) -> None:
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise AdapterError(f"{directory} exists and is not an empty directory; not overwriting")


def _check_positive_int(value: object, field: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise AdapterError(f"{field}={json.dumps(value)}: must be a positive integer")


def _check_positive_number(value: object, field: str) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise AdapterError(f"{field}={json.dumps(value)}: must be a positive finite number")


def _spec_from_json(data: dict[str, Any]) -> LoraSpec:
    """LoraSpec from adapter_config.json's object; errors name the field (no path)."""
    if data.get("peft_type") != "LORA":
        raise AdapterError(
            f"peft_type={json.dumps(data.get('peft_type'))}: only LORA adapters are supported"
        )
    for field, (accepted, reason) in _UNSUPPORTED.items():
        if data.get(field) not in accepted:
            raise AdapterError(f"{field}={json.dumps(data[field])}: {reason}")
    for field in ("r", "lora_alpha"):
        if field not in data:
            raise AdapterError(f"{field} is missing")
    _check_positive_int(data["r"], "r")
    _check_positive_number(data["lora_alpha"], "lora_alpha")
    use_rslora = data.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise AdapterError(f"use_rslora={json.dumps(use_rslora)}: must be true or false")
    base_model = data.get("base_model_name_or_path")
    if base_model is not None and not isinstance(base_model, str):
        raise AdapterError(
            f"base_model_name_or_path={json.dumps(base_model)}: must be a string or null"
        )
    modules = data.get("target_modules")
    targets: tuple[str, ...]
    if modules == "all-linear":
        targets = TARGETS
    elif isinstance(modules, list):
        try:
            targets = canonical_targets(modules)
        except AdapterError as err:
            raise AdapterError(f"target_modules={json.dumps(modules)}: {err}") from None
    else:
        raise AdapterError(
            f"target_modules={json.dumps(modules)}: expected a list of projection names "
            f'({", ".join(TARGETS)}) or "all-linear"; regular expressions are not supported'
        )
    return LoraSpec(data["r"], float(data["lora_alpha"]), use_rslora, targets, base_model)


def _spec_to_json(spec: LoraSpec) -> dict[str, Any]:
    """adapter_config.json as PEFT writes it for a plain LoRA adapter."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": spec.rank,
        "lora_alpha": int(spec.alpha) if spec.alpha.is_integer() else spec.alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(spec.targets),
        "use_rslora": spec.use_rslora,
        "bias": "none",
        "base_model_name_or_path": spec.base_model,
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": None,
        "use_dora": False,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "init_lora_weights": True,
        "revision": None,
    }


def _tensor_key(layer: int, target: str, factor: str) -> str:
    return _KEY.format(layer=layer, module=MODULE_OF[target], target=target, factor=factor)


def _read_safetensors(directory: Path) -> tuple[dict[str, dict[str, Any]], str, int]:
    """The tensors of adapter_model.safetensors (name -> {dtype, shape, data}), the file's
    sha256 and size; the file is read once, and `data` are views into its bytes."""
    file = directory / WEIGHTS_FILE
    if not file.is_file():
        if (directory / "adapter_model.bin").is_file():
            raise AdapterError(
                f"{file} is missing and {directory / 'adapter_model.bin'} (a pickle) is not "
                "supported: convert it to safetensors (load it with PEFT and save_pretrained)"
            )
        raise AdapterError(f"{file} is missing")
    try:
        data = file.read_bytes()
    except OSError as err:
        raise AdapterError(f"{file}: cannot read it ({err})") from err
    try:
        tensors = _safetensors_views(data)
    except ValueError as err:
        raise AdapterError(f"{file}: cannot read it as safetensors ({err})") from None
    return tensors, hashlib.sha256(data).hexdigest(), len(data)


# Bytes per element of the safetensors dtypes.
_ITEM_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2,
    "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip


def _safetensors_views(data: bytes) -> dict[str, dict[str, Any]]:
    """A safetensors file's tensors without a copy (so reading a large adapter never
    holds the GIL for long beside the running steps): name -> {dtype, shape, data}.

    The format: an 8-byte little-endian header length n, n bytes of JSON mapping each
    tensor name to {dtype, shape, data_offsets: [begin, end]} (and an optional
    "__metadata__"), then the tensors' bytes, the offsets relative to their start.
    Every entry is checked against the file: a ValueError says what is wrong.
    """
    if len(data) < 8:
        raise ValueError("shorter than the 8-byte header length")
    length = int.from_bytes(data[:8], "little")
    if length > len(data) - 8:
        raise ValueError(f"the header length {length} runs past the end of the file")
    try:
        header = json.loads(data[8 : 8 + length])
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"the header is not JSON: {err}") from None
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    body = memoryview(data)[8 + length :]
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise ValueError(f"tensor {name}: malformed entry {entry!r}") from None
        counts = [*shape, begin, end] if isinstance(shape, list) else None
        if dtype not in _ITEM_BYTES or counts is None:
            raise ValueError(f"tensor {name}: malformed entry {entry!r}")
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in counts):
            raise ValueError(f"tensor {name}: malformed entry {entry!r}")
        if not begin <= end <= len(body) or end - begin != math.prod(shape) * _ITEM_BYTES[dtype]:
            raise ValueError(
                f"tensor {name}: data_offsets {[begin, end]} do not hold {dtype}{shape} "
                f"within the {len(body)} bytes of data"
            )
        tensors[name] = {"dtype": dtype, "shape": shape, "data": body[begin:end]}
    return tensors


def _check_tensor_names(
    file: Path, spec: LoraSpec, tensors: dict[str, Any], num_layers: int
) -> None:
    """The names must be exactly lora_A and lora_B of each spec target on each layer."""
    present = sorted({int(m.group(1)) for m in map(_KEY_RE.fullmatch, tensors) if m})
    found = present[-1] + 1 if present else 0
    hint = (
        f" (the file has tensors for {found} layers, the base model has {num_layers}: the "
        "adapter was made for a different base model)"
        if found != num_layers
        else ""
    )
    expected = [
        _tensor_key(layer, target, factor)
        for layer in range(num_layers)
        for target in spec.targets
        for factor in "AB"
    ]
    for key in expected:
        if key not in tensors:
            raise AdapterError(f"{file}: tensor {key} is missing{hint}")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise AdapterError(
            f"{file}: unexpected tensor {unexpected[0]}{more}; expected only lora_A/lora_B of "
            f"target_modules {list(spec.targets)} on each layer{hint}"
        )


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
