"""Assemble the parameter pytree from named PyTorch-layout tensors.

Every loader (GGUF, Hugging Face safetensors) reduces to a function
`tensor(name) -> np.ndarray` in PyTorch layout (`[out, in]` for linear weights) under
Hugging Face Llama names; this module checks each shape against the model config,
transposes linear weights to Flax's `[in, out]`, stacks the layers and casts to the
serving dtype.

Memory: the pytree is built one parameter at a time (all layers of one projection),
straight in the serving dtype, and handed to `put` (the default device; with a mesh,
`TensorParallel.put_stored`: each device receives only its shard), which must finish
with it before the next is read: a bf16 checkpoint served in bf16 is never widened,
and the host holds at most one parameter's stack and one layer's tensor as read beside
what is already placed. Host buffers are 64-byte aligned, so that on the CPU the
default device adopts them without a copy (there the device's memory is the host's).
A safetensors tensor is read with `os.pread` into a buffer of its own (not through a
memory map, whose pages would stay resident beside the copy).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from configs import ModelConfig
from jlora.model.llama import Llama, Params


class WeightsError(ValueError):
    """A weight file is missing, malformed, or does not fit the model config."""


# Our layer modules -> the Hugging Face module inside `model.layers.{i}.` they load from.
LAYER_MODULES = {
    "attn_norm": "input_layernorm",
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "o_proj_bias": "self_attn.o_proj",
    "mlp_norm": "post_attention_layernorm",
    "gate_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
    "down_proj_bias": "mlp.down_proj",
}
# Our leaf -> the Hugging Face tensor's suffix, and whether it is transposed.
LEAVES = {"kernel": ("weight", True), "scale": ("weight", False), "bias": ("bias", False)}

TensorFn = Callable[[str], np.ndarray]  # HF tensor name (with ".weight") -> array
Progress = Callable[[int, int], None]  # (tensors done, tensors in all), after each tensor
# (the parameter's keys in the pytree, e.g. ("layers", "q_proj", "kernel"); its whole
# array on the host) -> the array placed
Put = Callable[[tuple[str, ...], np.ndarray], jax.Array]


def default_device(keys: tuple[str, ...], host: np.ndarray) -> jax.Array:
    return jax.device_put(host)  # the CPU adopts an aligned buffer; jnp.asarray would copy


ALIGNMENT = 64  # bytes: what XLA's CPU client needs to adopt a host buffer


def host_buffer(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialized array whose data is ALIGNMENT-byte aligned."""
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(nbytes + ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def assemble_params(
    config: ModelConfig,
    tensor: TensorFn,
    dtype: jnp.dtype,
    progress: Progress | None = None,
    put: Put = default_device,
) -> Params:
    """Build `Params` from `tensor(hf_name)`, each parameter placed by `put`; raise
    WeightsError naming a bad tensor."""
    shapes = Llama(config, dtype).param_shapes()
    host_dtype = np.dtype(dtype)
    layer_leaves = [
        (module, leaf) for module, leaves in shapes["layers"].items() for leaf in leaves
    ]
    total = 2 + ("lm_head" in shapes) + len(layer_leaves) * config.num_layers
    done = 0

    def fetch(name: str, expected: tuple[int, ...], transpose: bool) -> np.ndarray:
        """Tensor `name` as read (PyTorch's layout, its stored dtype), checked against
        `expected` (the Flax layout)."""
        nonlocal done
        array = tensor(name)
        torch_shape = tuple(reversed(expected)) if transpose else tuple(expected)
        if array.shape != torch_shape:
            raise WeightsError(
                f"tensor {name}: shape {array.shape} does not match the config "
                f"(expected {torch_shape})"
            )
        done += 1
        if progress is not None:
            progress(done, total)
        return array.T if transpose else array

    def placed(keys: tuple[str, ...], host: np.ndarray) -> jax.Array:
        return jax.block_until_ready(put(keys, host))  # before the next buffer is filled

    def single(keys: tuple[str, str], name: str, transpose: bool) -> jax.Array:
        shape = shapes[keys[0]][keys[1]].shape
        array = fetch(name, shape, transpose)
        if array.dtype != host_dtype or not array.flags.c_contiguous:
            out = host_buffer(shape, host_dtype)
            out[...] = array  # cast as it is written
            array = out
        return placed(keys, array)

    params: Params = {
        "embed": {"embedding": single(("embed", "embedding"), "model.embed_tokens.weight", False)},
        "final_norm": {"scale": single(("final_norm", "scale"), "model.norm.weight", False)},
        "layers": {},
    }
    if "lm_head" in shapes:
        params["lm_head"] = {"kernel": single(("lm_head", "kernel"), "lm_head.weight", True)}
    for module, leaf in layer_leaves:
        shape = shapes["layers"][module][leaf].shape
        suffix, transpose = LEAVES[leaf]
        stacked = host_buffer(shape, host_dtype)
        for i in range(config.num_layers):
            name = f"model.layers.{i}.{LAYER_MODULES[module]}.{suffix}"
            stacked[i] = fetch(name, shape[1:], transpose)  # cast as it is written
        params["layers"].setdefault(module, {})[leaf] = placed(("layers", module, leaf), stacked)
        del stacked
    return params


# -- safetensors ----------------------------------------------------------------------

# The safetensors dtypes served (read into the serving dtype); any other (I8, F8_*, ...) is
# a quantized or foreign format, refused naming the tensor.
_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}
INDEX_FILE = "model.safetensors.index.json"


class SafetensorsFile:
    """One `.safetensors` file: its header read once, each tensor read on demand."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            size = path.stat().st_size
            with path.open("rb") as stream:
                length = int.from_bytes(stream.read(8), "little")
                if not 0 < length <= size - 8:
                    raise self._error(f"its header length {length} runs past the end of the file")
                header = json.loads(stream.read(length))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise self._error(str(err)) from err
        if not isinstance(header, dict):
            raise self._error("the header is not a JSON object")
        header.pop("__metadata__", None)
        self._start = 8 + length
        for name, entry in header.items():
            try:
                begin, end = entry["data_offsets"]
                shape = [int(n) for n in entry["shape"]]
            except (TypeError, KeyError, ValueError):
                raise self._error(f"tensor {name} has a malformed entry {entry!r}") from None
            if not 0 <= begin <= end <= size - self._start or min(shape, default=0) < 0:
                raise self._error(f"tensor {name} runs past the end of the file")
        self.entries: dict[str, dict] = header

    def _error(self, why: str) -> WeightsError:
        return WeightsError(f"{self.path}: cannot read safetensors ({why})")

    def read(self, name: str) -> np.ndarray:
        """Tensor `name`, in its stored dtype, in a buffer of its own."""
        entry = self.entries[name]
        dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in _DTYPES:
            raise WeightsError(
                f"{self.path}: tensor {name} has dtype {dtype}; served are "
                f"{', '.join(_DTYPES)} (quantized weights are not supported)"
            )
        array = host_buffer(tuple(shape), np.dtype(_DTYPES[dtype]))
        if array.nbytes != end - begin:
            raise WeightsError(f"{self.path}: tensor {name}: {dtype}{shape} in {end - begin} bytes")
        view = memoryview(array.reshape(-1).view(np.uint8).data)
        with self.path.open("rb", buffering=0) as stream:
            fd, offset, read = stream.fileno(), self._start + begin, 0
            while read < array.nbytes:
                got = os.preadv(fd, [view[read:]], offset + read)
                if got <= 0:
                    raise WeightsError(f"{self.path}: tensor {name} runs past the end of the file")
                read += got
        return array


def safetensors_files(path: Path) -> list[Path]:
    """The weight files of a Hugging Face directory: those its index names (a sharded
    checkpoint, `model-0000N-of-0000M.safetensors`), else every `*.safetensors`."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise WeightsError(f"{index}: cannot read its weight_map ({err})") from err
        files = sorted({path / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise WeightsError(f"{index} names {missing}, which {path} does not hold")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"{path}: no *.safetensors files")
    return files


def load_safetensors_dir(
    path: Path,
    config: ModelConfig,
    dtype: jnp.dtype,
    progress: Progress | None = None,
    put: Put = default_device,
) -> Params:
    """A Hugging Face model directory: one or more `*.safetensors` files."""
    where: dict[str, SafetensorsFile] = {}
    for file in safetensors_files(path):
        reader = SafetensorsFile(file)
        where.update(dict.fromkeys(reader.entries, reader))

    def tensor(name: str) -> np.ndarray:
        if name not in where:
            raise WeightsError(f"{path}: tensor {name} is missing")
        return where[name].read(name)

    return assemble_params(config, tensor, dtype, progress, put)
