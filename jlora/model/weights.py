"""Assemble the parameter pytree from named PyTorch-layout tensors.

Every loader (GGUF, Hugging Face safetensors) reduces to a function
`tensor(name) -> np.ndarray` in PyTorch layout (`[out, in]` for linear weights)
under Hugging Face Llama names; this module checks each shape against the model
config, transposes linear weights to Flax's `[in, out]`, stacks the layers and
casts to the serving dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from configs import ModelConfig
from jlora.model.llama import Llama, Params


class WeightsError(ValueError):
    """A weight file is missing, malformed, or does not fit the model config."""


# our layer parameter -> Hugging Face name inside `model.layers.{i}.`
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "mlp_norm": "post_attention_layernorm",
    "gate_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}

TensorFn = Callable[[str], np.ndarray]  # HF tensor name (with ".weight") -> array
Progress = Callable[[int, int], None]  # (tensors done, tensors in all), after each tensor


def assemble_params(
    config: ModelConfig, tensor: TensorFn, dtype: jnp.dtype, progress: Progress | None = None
) -> Params:
    """Build `Params` from `tensor(hf_name)`; raise WeightsError naming a bad tensor."""
    shapes = Llama(config, dtype).param_shapes()
    total = 2 + ("lm_head" in shapes) + len(LAYER_TENSORS) * config.num_layers
    done = 0

    def fetch(name: str, expected: tuple[int, ...], transpose: bool) -> np.ndarray:
        """The tensor in Flax layout; `expected` is that layout's shape."""
        nonlocal done
        array = np.asarray(tensor(name), dtype=np.float32)
        done += 1
        if progress is not None:
            progress(done, total)
        torch_shape = tuple(reversed(expected)) if transpose else tuple(expected)
        if array.shape != torch_shape:
            raise WeightsError(
                f"tensor {name}: shape {array.shape} does not match the config "
                f"(expected {torch_shape})"
            )
        return array.T if transpose else array

    def to_device(array: np.ndarray) -> jax.Array:
        return jnp.asarray(array, dtype=dtype)

    params: Params = {
        "embed": {
            "embedding": to_device(
                fetch("model.embed_tokens.weight", shapes["embed"]["embedding"].shape, False)
            )
        },
        "final_norm": {
            "scale": to_device(
                fetch("model.norm.weight", shapes["final_norm"]["scale"].shape, False)
            )
        },
        "layers": {},
    }
    if "lm_head" in shapes:
        params["lm_head"] = {
            "kernel": to_device(fetch("lm_head.weight", shapes["lm_head"]["kernel"].shape, True))
        }
    for ours, hf in LAYER_TENSORS.items():
        leaf = "scale" if ours.endswith("norm") else "kernel"
        per_layer_shape = shapes["layers"][ours][leaf].shape[1:]
        stacked = np.stack(
            [
                fetch(f"model.layers.{i}.{hf}.weight", per_layer_shape, leaf == "kernel")
                for i in range(config.num_layers)
            ]
        )
        params["layers"][ours] = {leaf: to_device(stacked)}
    return params


def load_safetensors_dir(
    path, config: ModelConfig, dtype: jnp.dtype, progress: Progress | None = None
) -> Params:
    """A Hugging Face model directory: one or more `*.safetensors` files."""
    from safetensors import SafetensorError, safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"{path}: no *.safetensors files")
    where: dict[str, object] = {}
    try:
        handles = [safe_open(str(f), framework="numpy") for f in files]
    except (SafetensorError, OSError) as err:
        raise WeightsError(f"{path}: cannot read safetensors ({err})") from err
    for handle in handles:
        for key in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
            where[key] = handle

    def tensor(name: str) -> np.ndarray:
        if name not in where:
            raise WeightsError(f"{path}: tensor {name} is missing")
        return where[name].get_tensor(name)  # type: ignore[attr-defined]

    return assemble_params(config, tensor, dtype, progress)
