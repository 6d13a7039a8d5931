"""The router's views over its workers: the models they serve, their stats summed."""

from __future__ import annotations

from collections.abc import Sequence

from jlora.api import jlora_pb2 as pb
from router.workers import Worker


def served_models(workers: Sequence[Worker], base: str | None) -> list[pb.Model]:
    """The base model and every adapter the workers serve, at the smallest context, with
    the first worker's tool-call format."""
    contexts = [w.max_seq_len for w in workers if w.max_seq_len]
    context = min(contexts, default=0)
    parser = tool_call_parser(workers)
    models = (
        [pb.Model(id=base, kind=pb.MODEL_KIND_BASE, max_seq_len=context, tool_call_parser=parser)]
        if base
        else []
    )
    ranks: dict[str, int] = {}
    for worker in workers:
        ranks.update({a.name: a.rank for a in worker.adapters.values()})
    models += [
        pb.Model(
            id=name,
            kind=pb.MODEL_KIND_ADAPTER,
            parent=base or "",
            rank=rank,
            max_seq_len=context,
            tool_call_parser=parser,
        )
        for name, rank in sorted(ranks.items())
    ]
    return models


def tool_call_parser(workers: Sequence[Worker]) -> str:
    """The tool-call format of the first worker that has said which model it serves."""
    return next((w.tool_call_parser for w in workers if w.base_model is not None), "")


def summed_stats(workers: Sequence[Worker]) -> pb.StatsResponse:
    """The workers' last snapshots summed: the running batches concatenated, the queues,
    pools and prefix caches added up."""
    reply = pb.StatsResponse()
    contexts = []
    for worker in workers:
        stats = worker.stats
        if stats is None:
            continue
        reply.running.extend(stats.running)
        reply.waiting.extend(stats.waiting)
        reply.queued += stats.queued
        contexts.append(stats.max_seq_len)
        if worker.up:
            reply.max_slots += stats.max_slots
            reply.free_slots += stats.free_slots
        for field in (
            "kv_blocks_total",
            "kv_blocks_free",
            "host_store_bytes_used",
            "host_store_bytes_capacity",
        ):
            setattr(
                reply.memory, field, getattr(reply.memory, field) + getattr(stats.memory, field)
            )
        reply.memory.kv_block_size = stats.memory.kv_block_size
        reply.memory.kv_bytes_per_block = stats.memory.kv_bytes_per_block
        if stats.memory.HasField("cache"):
            _add_cache(reply.memory.cache, stats.memory.cache)
        for field in ("total", "free", "loading", "loads", "evictions"):
            setattr(
                reply.adapter_slots,
                field,
                getattr(reply.adapter_slots, field) + getattr(stats.adapter_slots, field),
            )
    reply.memory.device_bytes_in_use = reply.memory.device_bytes_limit = -1
    reply.max_seq_len = min(contexts, default=0)
    return reply


def _add_cache(total: pb.CacheStats, worker: pb.CacheStats) -> None:
    """Add a worker's pool and prefix-cache counts to `total`; the policy and the page
    size are the worker's (the workers of one deployment share them)."""
    for field in pb.CacheStats.DESCRIPTOR.fields:
        value = getattr(worker, field.name)
        if field.name not in ("policy", "page_bytes"):
            value += getattr(total, field.name)
        setattr(total, field.name, value)
