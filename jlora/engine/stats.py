"""An orchestrator's stats snapshot (`Orchestrator.stats`): the running batch and the
queue, the device's slots and memory, the pool and prefix cache, dLoRA's merging."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from jlora.engine.api import EngineStats, MergeStats, RunningInfo
from jlora.engine.scheduler import Sequence

if TYPE_CHECKING:
    from jlora.engine.orchestrator import Orchestrator


def engine_stats(orchestrator: Orchestrator) -> EngineStats:
    """The running batch, the queue, the slots and memory of `orchestrator`, now."""
    adapters, cfg = orchestrator.adapters, orchestrator.config
    if adapters is not None:
        adapters.poll()  # an idle engine installs landed loads here

    def info(seq: Sequence) -> RunningInfo:
        adapter = seq.request.adapter
        return RunningInfo(
            request_id=seq.request.request_id,
            adapter=adapter,
            rank=adapters.get(adapter).rank if adapters is not None and adapter else 0,
            slot=seq.row,
            prompt_tokens=len(seq.request.prompt_ids),
            generated_tokens=len(seq.generated),
            max_tokens=seq.request.sampling.max_tokens,
        )

    running = tuple(info(seq) for seq in orchestrator.scheduler.admitted())
    slots = adapters.slots if adapters is not None else None
    counts = slots.stats() if slots is not None else {}
    memory, cache = orchestrator.device.memory(), orchestrator.memory.stats()
    return EngineStats(
        running=running,
        waiting=orchestrator.num_waiting,
        max_slots=cfg.max_slots,
        max_seq_len=cfg.max_seq_len,
        kv_blocks_total=cfg.num_blocks,
        kv_blocks_free=cache.pages_total
        - cache.pages_lora
        - cache.pages_kv
        + cache.pages_kv_cached,
        kv_block_size=cfg.block_size,
        adapter_slots_total=orchestrator.device.adapter_slots,
        adapter_slots_free=slots.num_free if slots is not None else 0,
        adapter_slots_loading=len(slots.loading()) if slots is not None else 0,
        adapter_loads=counts.get("loads", 0),
        adapter_evictions=counts.get("evictions", 0),
        host_store_bytes_used=memory.host_store_used,
        host_store_bytes_capacity=memory.host_store_capacity,
        device_bytes_in_use=memory.device_in_use,
        device_bytes_limit=memory.device_limit,
        merging=_merge_stats(orchestrator),
        queued=tuple(info(seq) for seq in orchestrator.scheduler.waiting),
        kv_block_bytes=memory.kv_block_bytes,
        cache=cache,
        preemptions=orchestrator.counters["preemptions"],
        prefill_chunks=orchestrator.counters["prefill_chunks"],
        adapter_wait_s=orchestrator.scheduler.adapter_wait_s,
    )


def _merge_stats(orchestrator: Orchestrator) -> MergeStats | None:
    batcher = orchestrator.batcher
    if batcher is None:
        return None
    now, waits = time.monotonic(), dict.fromkeys(batcher.credits, 0.0)
    for seq in orchestrator.scheduler.sequences():
        if seq.row < 0 or seq.parked:  # queued or paused: not served this iteration
            adapter = seq.request.adapter
            waits[adapter] = max(waits.get(adapter, 0.0), now - seq.served_at)
    counters = batcher.counters
    return MergeStats(
        merged=orchestrator.device.merged,
        alpha=batcher.alpha,
        beta=batcher.beta,
        merged_iterations=counters["merged_iterations"],
        unmerged_iterations=counters["unmerged_iterations"],
        switches=counters["switches"],
        credits=tuple((name or "", credit) for name, credit in batcher.credits.items()),
        waits=tuple((name or "", wait) for name, wait in waits.items()),
    )
