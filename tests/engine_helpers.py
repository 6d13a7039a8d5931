"""Running requests through an engine in tests."""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from configs import EngineConfig
from jlora.device.llama_engine import LlamaEngine, build_engine
from jlora.engine.api import EngineStats, Request, SamplingParams
from jlora.engine.orchestrator import Orchestrator


def make_engine(loaded, **config) -> Orchestrator:
    """The serving engine (an orchestrator over a LlamaEngine) for a loaded model."""
    return build_engine(
        model_config=loaded.config,
        params=loaded.params,
        tokenizer=loaded.tokenizer,
        engine_config=EngineConfig(**config),
    )


def run_to_completion(
    engine: Orchestrator,
    prompts: list[list[int]],
    sampling: SamplingParams | list[SamplingParams],
    adapters: list[str | None] | None = None,
) -> list[dict]:
    """Queue every prompt at once (prompt i with adapters[i]), step until done; per
    prompt: token_ids, text, finish_reason."""
    samplings = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
    names = adapters if adapters is not None else [None] * len(prompts)
    for i, (ids, params, name) in enumerate(zip(prompts, samplings, names, strict=True)):
        engine.add_request(Request(f"r{i}", ids, params, adapter=name))
    results = {
        f"r{i}": {"token_ids": [], "text": "", "finish_reason": None} for i in range(len(prompts))
    }
    while engine.has_unfinished:
        for event in engine.step():
            result = results[event.request_id]
            assert result["finish_reason"] is None, "event after the request finished"
            assert event.error is None, f"{event.request_id} failed: {event.error!r}"
            result["token_ids"].append(event.token_id)
            result["text"] += event.text
            result["finish_reason"] = event.finish_reason
    return [results[f"r{i}"] for i in range(len(prompts))]


def step_until(engine: Orchestrator, done, timeout: float = 5.0) -> list:
    """Step until done() holds; the events of those steps."""
    events, deadline = [], time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "the condition never held"
        events += engine.step()
    return events


def kv_blocks(engine: Orchestrator | LlamaEngine, count: int) -> np.ndarray:
    """`count` blocks of the engine's KV cache that hold no adapter, for a model-level
    call on its cache (`.cache`): where the adapters live in the KV cache's pages
    (a pooled backend), a fresh cache would hold none of them. An orchestrator's pool
    says which pages its adapters own; a bare LlamaEngine's adapters sit at the top
    (`slot_pages`)."""
    device = getattr(engine, "device", engine)
    if isinstance(engine, Orchestrator):
        owned = engine.memory.pool.owned()
        free = [page for page in range(engine.config.num_blocks) if page not in owned]
    elif device.lora is not None and device.lora.backend.pooled:
        free = list(range(min(device.slot_pages(device.config.max_loras - 1))))
    else:
        free = list(range(device.config.num_blocks))
    assert len(free) >= count, f"{count} KV blocks asked, {len(free)} hold no adapter"
    return np.asarray(free[:count], np.int32)


def engine_stats(**fields) -> EngineStats:
    """An idle engine's stats snapshot (4 slots, 16 KV blocks, 2 adapter slots), with
    `fields` in place."""
    idle = EngineStats(
        running=(),
        waiting=0,
        max_slots=4,
        max_seq_len=64,
        kv_blocks_total=16,
        kv_blocks_free=16,
        kv_block_size=16,
        adapter_slots_total=2,
        adapter_slots_free=2,
        adapter_slots_loading=0,
        adapter_loads=0,
        adapter_evictions=0,
    )
    return dataclasses.replace(idle, **fields)
