"""A PEFT LoRA adapter directory as both sides read it: its config and its file's
tensor names, checked without a base model, and the file's content hash.

A PEFT directory holds `adapter_config.json` and `adapter_model.safetensors`. The file
stores, for each layer `l` and target projection, two tensors in PyTorch Linear layout:

    base_model.model.model.layers.{l}.{self_attn|mlp}.{target}.lora_A.weight  [rank, in]
    base_model.model.model.layers.{l}.{self_attn|mlp}.{target}.lora_B.weight  [out, rank]

and PEFT computes `y = x @ W.T + scaling * (x @ lora_A.T) @ lora_B.T`. `read_adapter_config`
parses the config into an `Adapter` record (no weights read); `inspect_adapter` adds the
file's sha256 and size and checks its tensor names for every layer. Anything jlora
cannot serve exactly (DoRA, bias terms, whole trained modules, per-module ranks) is
refused with an `AdapterError` that names the path and the field or tensor. The worker
reads the tensors themselves against its base model (`jlora.adapters.peft`).

The router registers adapters with this module, so it imports no numpy and no jax.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from configs.engine import LORA_TARGETS as TARGETS
from jlora.contract.adapters import (
    CONFIG_FILE,
    MODULE_OF,
    WEIGHTS_FILE,
    Adapter,
    AdapterError,
    canonical_targets,
    sha256_of,
)

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


def check_ranks(ranks: Iterable[int]) -> tuple[int, ...]:
    """`ranks` as a non-empty tuple of positive ints, or AdapterError naming the bad one."""
    ranks = tuple(ranks)
    if not ranks:
        raise AdapterError("ranks: at least one rank is needed")
    for rank in ranks:
        _check_positive_int(rank, "rank")
    return ranks


def read_adapter_config(path: str | Path) -> Adapter:
    """Parse and validate `path/adapter_config.json` (no weights are read): the record
    with its path, rank, alpha, targets, use_rslora and base_model."""
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
        return _adapter_from_json(data, directory)
    except AdapterError as err:
        raise AdapterError(f"{file}: {err}") from None


def inspect_adapter(path: str | Path) -> tuple[Adapter, int]:
    """Read an adapter without a base model: its config, its file's sha256 and size, and
    the layer count its tensor names imply, which must be LoRA tensors of its targets for
    every layer (shapes and values are only checked against a base model, by
    `jlora.adapters.peft.load_peft_adapter`)."""
    adapter = read_adapter_config(path)
    directory = Path(path)
    tensors, sha256, nbytes = read_safetensors(directory)
    file = directory / WEIGHTS_FILE
    layers = [int(m.group(1)) for m in map(_KEY_RE.fullmatch, tensors) if m]
    if not layers:
        raise AdapterError(f"{file}: no lora_A/lora_B tensors of decoder layers")
    check_tensor_names(file, adapter, tensors, max(layers) + 1)
    return dataclasses.replace(adapter, sha256=sha256, size_bytes=nbytes), max(layers) + 1


# -- helpers -------------------------------------------------------------------


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


def _adapter_from_json(data: dict[str, Any], directory: Path) -> Adapter:
    """The record of adapter_config.json's object; errors name the field (no path)."""
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
    return Adapter(
        path=str(directory),
        rank=data["r"],
        alpha=float(data["lora_alpha"]),
        targets=targets,
        use_rslora=use_rslora,
        base_model=base_model,
    )


def adapter_config(adapter: Adapter) -> dict[str, Any]:
    """adapter_config.json as PEFT writes it for a plain LoRA adapter."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": adapter.rank,
        "lora_alpha": int(adapter.alpha) if adapter.alpha.is_integer() else adapter.alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(adapter.targets),
        "use_rslora": adapter.use_rslora,
        "bias": "none",
        "base_model_name_or_path": adapter.base_model,
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


def tensor_key(layer: int, target: str, factor: str) -> str:
    return _KEY.format(layer=layer, module=MODULE_OF[target], target=target, factor=factor)


def read_safetensors(directory: Path) -> tuple[dict[str, dict[str, Any]], str, int]:
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
    return tensors, sha256_of(data), len(data)


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


def check_tensor_names(
    file: Path, adapter: Adapter, tensors: dict[str, Any], num_layers: int
) -> None:
    """The names must be exactly lora_A and lora_B of each of the adapter's targets on each
    layer."""
    present = sorted({int(m.group(1)) for m in map(_KEY_RE.fullmatch, tensors) if m})
    found = present[-1] + 1 if present else 0
    hint = (
        f" (the file has tensors for {found} layers, the base model has {num_layers}: the "
        "adapter was made for a different base model)"
        if found != num_layers
        else ""
    )
    expected = [
        tensor_key(layer, target, factor)
        for layer in range(num_layers)
        for target in adapter.targets
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
            f"target_modules {list(adapter.targets)} on each layer{hint}"
        )
