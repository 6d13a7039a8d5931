"""Run one prompt through jlora's model and through a transformers oracle.

Both return the fp32 logits at the prompt's last position, so a test compares the
models alone (same token ids, no sampling, no engine).
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from jlora.model.kv_cache import KVCache
from jlora.model.llama import Llama
from jlora.model.lora.base import Segments
from tests.engine_helpers import kv_blocks

# A tiny random Llama for transformers' config classes: GQA (4 heads over 2 KV heads),
# weights drawn with std 0.2, so that a wrong detail moves the logits past any tolerance.
TINY_HF = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    max_position_embeddings=256,
    initializer_range=0.2,
)


def jlora_last_logits(
    loaded,
    ids: list[int],
    *,
    bucket: int = 64,
    block_size: int = 16,
    params=None,
    engine=None,
    adapter: str | None = None,
) -> np.ndarray:
    """`Llama.prefill` of `ids` (padded to `bucket`) on a fresh paged cache -> f32[V].

    The cache and the computation take the dtype of the loaded parameters; `params`
    replaces them. With a LoRA `engine`, its model runs with its device adapter slots,
    the prompt on `adapter`'s slot (None: no adapter), on the engine's own cache (where
    its adapters may live) in blocks no adapter holds, which it leaves as they were.
    """
    if not 0 < len(ids) <= bucket:
        raise ValueError(f"{len(ids)} tokens do not fit the bucket of {bucket}")
    num_blocks = bucket // block_size
    dtype = jax.tree.leaves(loaded.params)[0].dtype
    cache = KVCache.zeros(
        num_layers=loaded.config.num_layers,
        num_blocks=num_blocks,
        block_size=block_size,
        num_kv_heads=loaded.config.num_kv_heads,
        head_dim=loaded.config.head_dim,
        dtype=dtype,
    )
    tokens = np.zeros(bucket, np.int32)
    tokens[: len(ids)] = ids
    args = [
        loaded.params if params is None else params,
        cache,
        tokens,
        np.int32(len(ids)),
        np.arange(num_blocks, dtype=np.int32),
    ]
    if engine is None:
        prefill = _jitted_prefill(_base_model(loaded.config, dtype))
    else:
        prefill = _jitted_prefill(engine.device.model)
        slot = -1 if adapter is None else engine.adapters.slots.slot_of(adapter)
        args[1], args[4] = engine.device.cache, kv_blocks(engine, num_blocks)
        args += [engine.device.lora.weights, Segments.single(slot, bucket)]
    logits, _ = prefill(*args)
    return np.asarray(logits)


@functools.cache
def _base_model(config, dtype) -> Llama:
    """One model per shape and dtype (ModelConfig is frozen, hashable)."""
    return Llama(config, dtype)


@functools.cache
def _jitted_prefill(model: Llama):
    """One jitted prefill per model object, so repeated calls compile once."""
    return jax.jit(model.prefill)


def hf_last_logits(hf_model, ids: list[int]) -> np.ndarray:
    """A transformers causal LM's logits at the last position -> f32[V]."""
    import torch

    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0, -1].float().numpy()


def tiny_llama_with_adapter(tmp_path_factory, seed: int, **config):
    """(jlora's load, PEFT's model over transformers', the adapter's directory): a tiny
    random transformers Llama (TINY_HF with `config`) and a rank-8 PEFT adapter on all
    its projections, A and B drawn at random."""
    import copy

    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    from jlora.model.loading import load_model

    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_HF, **config)).eval()
    base = tmp_path_factory.mktemp("base")
    hf.save_pretrained(base)
    peft = get_peft_model(
        copy.deepcopy(hf), LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")
    )
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 1.0 / param.shape[1] ** 0.5)
    adapter = tmp_path_factory.mktemp("adapter")
    peft.save_pretrained(adapter)
    return load_model(str(base)), peft.eval(), adapter
