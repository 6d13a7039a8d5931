"""A jlora model directory: orbax parameters + config + tokenizer.

Layout written by `jlora convert`:

    DIR/jlora_model.json      {"format": 1, "config": ModelConfig fields, "source": ...}
    DIR/params/               orbax StandardCheckpointer tree (the Params pytree)
    DIR/tokenizer.json        tokenizers BPE (when the source had a tokenizer)
    DIR/tokenizer_config.json bos/eos ids and chat template

orbax (and tensorstore) are imported lazily: kernels and benchmarks do not need them.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp

from configs import ModelConfig
from jlora.model.llama import Llama, Params
from jlora.model.weights import WeightsError
from jlora.tokenizer import Tokenizer

MARKER = "jlora_model.json"
FORMAT_VERSION = 1


def save_checkpoint(
    path: Path, config: ModelConfig, params: Params, tokenizer: Tokenizer | None, source: str
) -> None:
    import orbax.checkpoint as ocp

    path = path.absolute()
    if path.exists() and any(path.iterdir()):
        raise WeightsError(f"{path}: output directory exists and is not empty")
    path.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path / "params", params)
        checkpointer.wait_until_finished()
    if tokenizer is not None:
        tokenizer.save(path)
    meta = {
        "format": FORMAT_VERSION,
        "config": config.to_dict(),
        "source": source,
        "dtype": str(jax.tree.leaves(params)[0].dtype),
    }
    (path / MARKER).write_text(json.dumps(meta, indent=2))


def is_checkpoint(path: Path) -> bool:
    return (path / MARKER).is_file()


def checkpoint_config(path: Path) -> ModelConfig:
    """The model config a checkpoint holds (its weights are not read)."""
    meta = json.loads((path.absolute() / MARKER).read_text())
    if meta.get("format") != FORMAT_VERSION:
        raise WeightsError(
            f"{path / MARKER}: format={meta.get('format')!r} is not {FORMAT_VERSION}"
        )
    return ModelConfig.from_dict(meta["config"])


def load_checkpoint(
    path: Path, dtype: jnp.dtype, shardings: Params | None = None
) -> tuple[ModelConfig, Params, Tokenizer | None]:
    """Restore into the serving dtype. `shardings` (a pytree like the parameters') puts
    every leaf straight into its place on a mesh, each process reading only the shards
    its devices hold (default: all on device 0)."""
    import orbax.checkpoint as ocp

    path = path.absolute()
    config = checkpoint_config(path)
    shapes = Llama(config, dtype).param_shapes()
    if shardings is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: device, shapes)
    abstract = jax.tree.map(
        lambda s, sharding: jax.ShapeDtypeStruct(s.shape, dtype, sharding=sharding),
        shapes,
        shardings,
    )
    with ocp.StandardCheckpointer() as checkpointer:
        params = checkpointer.restore(path / "params", abstract)
    tokenizer = Tokenizer.from_dir(path) if (path / "tokenizer.json").is_file() else None
    return config, params, tokenizer
