"""The device engine's warm-up: every step shape it will serve, compiled before it serves.

Compile each prefill bucket up to the one the longest of `prompt_lengths` needs
    (or all; none above the bucket of `prefill_token_budget` unless merging, which
    prefills whole, is on), plain and continuing a cached prefix; the packed
    prefill's (those from the shortest prompt's bucket up), and each decode bucket up
    to the one holding `max_length` tokens (or all); with LoRA, each of these twice:
    with the adapter slots and without (`base_steps`, the calls whose rows have no
    adapter, and merged inference). Every bucket below the longest
    prompt's, because a step may prefill any part of a prompt: a chunk under the
    token budget, or one ended early on a smaller bucket (`Scheduler._chunk_end`),
    the rest continuing after it as after a cached prefix (as a prefix cache hit
    does). CPU assistance, which prefills prompts whole, compiles their buckets
    alone. With `on_demand`, only what CPU assistance needs ahead (its segments, and
    in auto mode the device prefills its cost model times); every other shape
    compiles when first met, and `warmed_up` stays false, so that is not logged as a
    warning.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from configs import bucket
from jlora.device.steps import CompiledSteps
from jlora.model.lora.base import LoraWeights

if TYPE_CHECKING:
    from jlora.device.llama_engine import LlamaEngine


def warm_up(
    engine: LlamaEngine,
    prompt_lengths: list[int] | None = None,
    max_length: int | None = None,
    *,
    on_demand: bool = False,
) -> None:
    """Compile what `engine` serves (see the module docstring)."""
    cfg = engine.config
    buckets = cfg.prefill_buckets
    prompts = (
        buckets if prompt_lengths is None else sorted({bucket(buckets, n) for n in prompt_lengths})
    )
    if engine.assisted is not None:
        for size in prompts:
            engine.assisted.compile(engine.params, engine.cache, size)
        if cfg.lora_mode == "auto":
            for size in prompts:  # the device prefills the cost model times
                engine.steps.compile_prefill(
                    engine.params, engine.cache, size, cfg.blocks_per_seq, engine.lora_weights
                )
            engine.cache = engine.assisted.measure(engine.params, engine.cache, prompts)
    if on_demand:
        return
    top = prompts[-1] if prompts else 0
    if cfg.merge == "never":  # chunked: a step prefills at most the budget's tokens
        top = min(top, bucket(buckets, min(cfg.prefill_token_budget, cfg.max_seq_len)))
    prefill = [size for size in buckets if size <= top]
    longest = bucket(cfg.decode_buckets, min(max_length or cfg.max_seq_len, cfg.max_seq_len))
    # A packed call's bucket holds at least its shortest prompt.
    smallest = min(prompts[0], top) if prompts else cfg.max_seq_len + 1
    for size in prefill:
        for cached in (False, True):  # a prefix hit or a later chunk: the cached variant
            engine.steps.compile_prefill(
                engine.params,
                engine.cache,
                size,
                cfg.blocks_per_seq,
                engine.lora_weights,
                cached=cached,
            )
    engine.packed.compile(engine.steps, engine.params, engine.cache, engine.lora_weights, smallest)
    decode = cfg.decode_buckets[: cfg.decode_buckets.index(longest) + 1]
    compile_decodes(engine, engine.steps, decode, engine.lora_weights)
    if cfg.cache_policy != "none" and engine.can_swap_kv:
        engine.cache = engine.kv_blocks.warm(engine.cache)
    engine.steps.warmed_up = True
    if engine.base_steps is not None:  # rows with no adapter, or a merged one
        for size in prefill:
            for cached in (False, True):
                engine.base_steps.compile_prefill(
                    engine.params, engine.cache, size, cfg.blocks_per_seq, None, cached=cached
                )
        engine.packed.compile(engine.base_steps, engine.params, engine.cache, None, smallest)
        compile_decodes(engine, engine.base_steps, decode, None)
        engine.base_steps.warmed_up = True
    if cfg.merge != "never" and engine.merger is not None:
        assert engine.store is not None
        for name in engine.store.names():
            spec = engine.store.get(name).adapter
            engine.merger.compile(spec.targets, spec.rank)
        engine.merger.warmed_up = True


def compile_decodes(
    engine: LlamaEngine, steps: CompiledSteps, sizes: Sequence[int], weights: LoraWeights | None
) -> None:
    """Compile and prime the decode of each row bucket over each of `sizes` keys."""
    cfg = engine.config
    for size in sizes:
        blocks = size // cfg.block_size
        for rows in cfg.decode_row_buckets:
            steps.compile_decode(engine.params, engine.cache, rows, blocks, weights)
            engine.cache = steps.prime_decode(engine.params, engine.cache, rows, blocks, weights)
