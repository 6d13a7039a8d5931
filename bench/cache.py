"""FastLibra's comparison on jlora: one multi-turn chatbot workload (FastLibra §6.2)
served under the three cache policies, FastLibra and its baselines (§6.1).

Run: `python -m bench.cache [--quick] [--scenario chat|many-adapters|contention]` (`make
bench-cache` runs the three scenarios; about 5 minutes each on two cores, `--quick` one
or two). Writes `bench/results/<date>-cpu-cache[-SCENARIO].md` and `.json` (chat: no suffix).

Setup (one process): SmolLM2 in fp32, `adapters` demo adapters of mixed ranks on all
seven projections, loaded on demand into device slots over an emulated
host-to-device link of `link_gbps` (a CPU has no real link, so loads and KV swaps would
otherwise cost nothing), a device pool of `pool_blocks` KV blocks (pool_bytes, measured
in SmolLM2's KV blocks) small enough that history KV must leave it, and a host pool
for what is swapped out. Three engines are built in turn on the same weights, one per
`EngineConfig.cache_policy`:

- `fastlibra`: one pool for KV and adapters, history KV kept in a tree under its
  adapter, a cost-model swapper (FastLibra);
- `lru`: a static share of the pool for `max_loras` adapter slots at the top rank
  (vLLM's --max-loras), history KV evicted least recently used to the host pool,
  adapters evicted whatever KV depends on them (the paper's vLLM baseline, with its
  swap-out);
- `none`: one pool, no history KV (S-LoRA).

In the two unified policies the pool, not a slot count, decides how many adapters are
resident (FastLibra §5.1): the adapters live in the pool's pages, and the engine has as
many slots as the pool has pages (EngineConfig.max_loras). Only `lru` sets a share of
the pool aside for its `max_loras` slots.

Each replays the same `multiturn_workload` (`bench.lib.workloads`), closed loop within
a session: turn k is sent at max(its trace arrival, turn k-1's finish + think_s), its
prompt turn k-1's prompt + turn k-1's generated tokens + its new message
(`Conversations`). Greedy decoding with EOS ignored, so every answer has exactly its
max_tokens and the three policies should produce the same tokens; the report counts the
turns that do not, and says where each session first differs (`divergences`). A prefill
after a cached prefix and one of the whole prompt are not the same arithmetic, and with
more than one decode row a step's padding (the bucket of the longest row beside it)
depends on timing, so a near-tie in a greedy choice may flip: one test runs a single row
and asserts equality. Each engine is warmed first (every prefill, cached-prefix prefill
and decode bucket compiled, one adapter of each rank loaded and unloaded, no KV left
cached), and its counters are taken from there.

Reported per policy: TTFT (from the turn's send time to its first token) mean and P90,
TPOT mean, the prefix cache's hit rate (hit tokens over prompt tokens), the device pool
by kind averaged over the engine's steps (running KV, cached KV, adapters, free), KV
swaps out and in, the most invalid KV pages seen (KV whose adapter is off the device;
0 under fastlibra by design), adapter loads, the mean time a turn waited queued for its
adapter (`EngineStats.adapter_wait_s`), output tokens per second of the run.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.lib.report import dated_stem, machine_facts, write_report
from bench.lib.workloads import (
    MultiTurnWorkload,
    Turn,
    demo_adapter_pool,
    multiturn_workload,
)
from configs import EngineConfig, ModelConfig
from jlora.adapters.peft import make_demo_adapters
from jlora.device.llama_engine import build_engine
from jlora.engine.api import CacheStats, EngineStats, Request, SamplingParams
from jlora.engine.orchestrator import Orchestrator
from jlora.model.loading import LoadedModel, load_model

POLICIES = ("fastlibra", "lru", "none")  # the first is the reference for the outputs
RESULTS = Path(__file__).parent / "results"
FP32_BYTES = 4


@dataclasses.dataclass(frozen=True)
class Plan:
    model: str = "smollm2-135m"
    adapters: int = 8
    ranks: tuple[int, ...] = (8, 16)  # cycling: demo-00-r8, demo-01-r16, ...
    max_loras: int = 4
    slots: int = 4
    max_seq_len: int = 1024
    prefill_buckets: tuple[int, ...] = (64, 128, 256, 512, 1024)
    # The device pool, in KV blocks of 16 tokens (0.7 MiB each for SmolLM2 in fp32; a
    # rank-8 adapter on all seven projections takes 14 of them, rank 16 takes 27).
    pool_blocks: int = 224
    host_pool_mib: int = 512
    link_gbps: float = 1.0
    trace: str = "conv"
    turns: int = 48
    rate_scale: float = 0.4
    message_scale: float = 0.1
    output_scale: float = 0.1
    message_tokens: tuple[int, int] = (16, 128)
    output_tokens: tuple[int, int] = (8, 24)
    continue_p: float = 0.8
    mean_turns: float = 8.0
    max_context_tokens: int = 704
    think_s: float = 1.0
    zipf_s: float = 1.0
    base_fraction: float = 0.1
    seed: int = 0
    policies: tuple[str, ...] = POLICIES
    # Compile each shape when the replay first meets it, not every bucket ahead: for a
    # check of the tokens (the tests), where TTFT does not matter.
    warmup_on_demand: bool = False


QUICK = Plan(
    adapters=4,
    max_loras=2,
    max_seq_len=256,
    prefill_buckets=(64, 128, 256),
    pool_blocks=80,
    turns=12,
    rate_scale=1.0,
    message_tokens=(16, 48),
    output_tokens=(4, 12),
    max_context_tokens=224,
    think_s=0.5,
    zipf_s=0.0,
)


def kv_block_bytes(config: ModelConfig, block_size: int) -> int:
    """One KV block in fp32: keys and values of `block_size` tokens in every layer."""
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * FP32_BYTES


def make_workload(plan: Plan, tokenizer: Any) -> MultiTurnWorkload:
    return multiturn_workload(
        trace=plan.trace,
        rate_scale=plan.rate_scale,
        max_turns=plan.turns,
        message_scale=plan.message_scale,
        output_scale=plan.output_scale,
        message_tokens=plan.message_tokens,
        output_tokens=plan.output_tokens,
        continue_p=plan.continue_p,
        mean_turns=plan.mean_turns,
        max_context_tokens=plan.max_context_tokens,
        think_s=plan.think_s,
        adapters=demo_adapter_pool(plan.adapters, plan.ranks),
        zipf_s=plan.zipf_s,
        base_fraction=plan.base_fraction,
        seed=plan.seed,
        tokenizer=tokenizer,
    )


# -- the replay ------------------------------------------------------------------------


class Conversations:
    """The prompts of a multi-turn workload, assembled as its turns are sent.

    Turn k's prompt, in token ids: turn k-1's prompt, the tokens turn k-1 generated,
    then `encode(turn k's message)`. Ids are concatenated, not text, so each prompt
    extends the previous one exactly (encoding the joined text again could merge tokens
    across the join, and the prefix cache would miss).
    """

    def __init__(self, encode: Callable[[str], list[int]]) -> None:
        self.encode = encode
        self._history: dict[str, list[int]] = {}  # session: its last prompt + answer
        self._next: dict[str, int] = {}  # session: the index of its next turn

    def prompt(self, turn: Turn) -> list[int]:
        """Turn's prompt; ValueError unless the session's previous turn has finished."""
        expected = self._next.get(turn.session, 0)
        if turn.index != expected:
            raise ValueError(
                f"turn {turn.id}: session {turn.session!r} is at turn {expected}, "
                f"not {turn.index} (a turn is sent after its previous turn finished)"
            )
        return [*self._history.get(turn.session, ()), *self.encode(turn.message)]

    def finish(self, turn: Turn, prompt: Sequence[int], generated: Sequence[int]) -> None:
        """Turn has finished: `prompt` (as `prompt(turn)` gave it) and its answer."""
        self._history[turn.session] = [*prompt, *generated]
        self._next[turn.session] = turn.index + 1


@dataclasses.dataclass
class TurnRecord:
    """One sent turn; times in seconds after the replay started."""

    turn: Turn
    due: float  # when it was to be sent: max(arrival, previous finish + think_s)
    prompt: list[int]
    first: float | None = None
    finished: float | None = None
    cached_tokens: int = 0
    tokens: list[int] = dataclasses.field(default_factory=list)


def replay(
    engine: Orchestrator,
    workload: MultiTurnWorkload,
    encode: Callable[[str], list[int]],
    *,
    on_step: Callable[[], None] = lambda: None,
) -> tuple[dict[str, TurnRecord], float]:
    """Serve every turn in this process, closed loop within each session; `on_step` runs
    after each engine step. Returns the records by turn id and the makespan (s)."""
    sessions = workload.sessions()
    conversations = Conversations(encode)
    due: list[tuple[float, str]] = [
        (turns[0].arrival_s, turns[0].id) for turns in sessions.values()
    ]
    heapq.heapify(due)
    by_id = {turn.id: turn for turn in workload.turns}
    records: dict[str, TurnRecord] = {}
    start = time.monotonic()
    while due or engine.has_unfinished:
        now = time.monotonic() - start
        while due and due[0][0] <= now:
            when, turn_id = heapq.heappop(due)
            turn = by_id[turn_id]
            record = records[turn_id] = TurnRecord(turn, when, conversations.prompt(turn))
            sampling = SamplingParams(max_tokens=turn.max_tokens, temperature=0.0, ignore_eos=True)
            engine.add_request(Request(turn_id, record.prompt, sampling, turn.adapter))
        if not engine.has_unfinished:
            time.sleep(max(0.0, due[0][0] - now))
            continue
        events = engine.step()
        stamp = time.monotonic() - start
        on_step()
        for event in events:
            if event.error is not None:
                raise RuntimeError(f"turn {event.request_id} failed: {event.error}")
            record = records[event.request_id]
            if record.first is None:
                record.first, record.cached_tokens = stamp, event.cached_tokens
            record.tokens.append(event.token_id)
            if event.finish_reason is None:
                continue
            record.finished = stamp
            turn = record.turn
            conversations.finish(turn, record.prompt, record.tokens)
            following = sessions[turn.session][turn.index + 1 :]
            if following:
                upcoming = following[0]
                ready = max(upcoming.arrival_s, stamp + workload.think_s)
                heapq.heappush(due, (ready, upcoming.id))
    return records, time.monotonic() - start


# -- metrics ---------------------------------------------------------------------------


def summarize(
    records: dict[str, TurnRecord],
    makespan: float,
    samples: Sequence[CacheStats],
    before: EngineStats,
    after: EngineStats,
) -> dict[str, Any]:
    """One policy's row: the pool `samples` taken after each step, the counters the
    difference of the engine's stats `before` and `after` the replay."""
    assert before.cache is not None and after.cache is not None
    adapter_loads = after.adapter_loads - before.adapter_loads
    first, last = before.cache, after.cache
    done = list(records.values())
    ttft = np.array([r.first - r.due for r in done])  # type: ignore[operator]
    tpot = [
        (r.finished - r.first) / (len(r.tokens) - 1)  # type: ignore[operator]
        for r in done
        if len(r.tokens) > 1
    ]
    prompt_tokens = last.prompt_tokens - first.prompt_tokens
    hit_tokens = last.hit_tokens - first.hit_tokens
    total = last.pages_total

    def mean_share(pages: Callable[[CacheStats], int]) -> float:
        return float(np.mean([pages(s) for s in samples]) / total) if samples else 0.0

    tokens = sum(len(r.tokens) for r in done)
    return {
        "policy": last.policy,
        "turns": len(done),
        "mean_ttft_s": float(ttft.mean()),
        "p90_ttft_s": float(np.percentile(ttft, 90)),
        "mean_tpot_s": float(np.mean(tpot)) if tpot else math.nan,
        "prompt_tokens": prompt_tokens,
        "hit_tokens": hit_tokens,
        "hit_rate": hit_tokens / prompt_tokens if prompt_tokens else 0.0,
        "pool_pages": total,
        "kv_running_share": mean_share(lambda s: s.pages_kv - s.pages_kv_cached),
        "kv_cached_share": mean_share(lambda s: s.pages_kv_cached),
        "lora_share": mean_share(lambda s: s.pages_lora),
        "free_share": mean_share(lambda s: s.pages_total - s.pages_kv - s.pages_lora),
        "swaps_out": last.swaps_out - first.swaps_out,
        "swaps_in": last.swaps_in - first.swaps_in,
        "swap_out_mib": (last.swap_out_bytes - first.swap_out_bytes) / 2**20,
        "swap_in_mib": (last.swap_in_bytes - first.swap_in_bytes) / 2**20,
        "max_invalid_kv_pages": max((s.invalid_kv_pages for s in samples), default=0),
        "adapter_loads": adapter_loads,
        "adapter_wait_s": (after.adapter_wait_s - before.adapter_wait_s) / max(len(done), 1),
        "output_tokens": tokens,
        "makespan_s": makespan,
        "throughput_tokens_per_s": tokens / makespan,
    }


def mismatches(reference: dict[str, TurnRecord], other: dict[str, TurnRecord]) -> list[str]:
    """Turn ids whose generated tokens differ between two replays (a difference in turn
    k changes the prompts of the session's later turns, so they are counted too)."""
    return sorted(t for t in reference if reference[t].tokens != other[t].tokens)


def divergences(reference: dict[str, TurnRecord], other: dict[str, TurnRecord]) -> list[dict]:
    """Where each session's tokens first differ between two replays: the turn, the
    position of the first differing token, and the prompt tokens each replay took from
    the prefix cache for that turn (its prompt is the same in both)."""
    first: dict[str, dict[str, Any]] = {}
    for turn_id in mismatches(reference, other):
        ours, theirs = reference[turn_id], other[turn_id]
        session, index = ours.turn.session, ours.turn.index
        if session in first and first[session]["index"] < index:
            continue
        pairs = enumerate(zip(ours.tokens, theirs.tokens, strict=True))  # max_tokens each
        position = next(i for i, (mine, yours) in pairs if mine != yours)
        first[session] = {
            "turn": turn_id,
            "index": index,
            "token": position,
            "cached_tokens": [ours.cached_tokens, theirs.cached_tokens],
        }
    return sorted(first.values(), key=lambda entry: entry["turn"])


# -- one engine per policy --------------------------------------------------------------


def engine_config(plan: Plan, policy: str, block_bytes: int) -> EngineConfig:
    return EngineConfig(
        max_slots=plan.slots,
        max_seq_len=plan.max_seq_len,
        prefill_buckets=plan.prefill_buckets,
        max_loras=plan.max_loras,  # lru's slots; the pool's pages bind the others
        max_lora_rank=max(plan.ranks),
        lora_mode="ondemand",
        cache_policy=policy,
        pool_bytes=plan.pool_blocks * block_bytes,
        host_pool_mib=plan.host_pool_mib,
        emulated_link_gbps=plan.link_gbps,
    )


def build(loaded: LoadedModel, plan: Plan, policy: str, adapter_paths: list[Path]) -> Orchestrator:
    """An engine for `policy` with every adapter registered (none on the device), warmed."""
    block_bytes = kv_block_bytes(loaded.config, EngineConfig.block_size)
    engine = build_engine(
        model_config=loaded.config,
        params=loaded.params,
        tokenizer=loaded.tokenizer,
        engine_config=engine_config(plan, policy, block_bytes),
    )
    measured = engine.stats().kv_block_bytes
    if measured != block_bytes:
        raise RuntimeError(f"a KV block holds {measured} bytes, not {block_bytes} as computed")
    for path in adapter_paths:
        engine.register_adapter(path.name, path)
    engine.warmup(max_length=plan.max_seq_len, on_demand=plan.warmup_on_demand)
    # One adapter of each rank through a load and a prefill, then off the device again.
    # Eight prompt tokens and four generated fill no KV block, so nothing stays cached.
    first_of_rank = {int(path.name.rsplit("-r", 1)[1]): path.name for path in adapter_paths}
    for rank, name in sorted(first_of_rank.items()):
        sampling = SamplingParams(max_tokens=4, ignore_eos=True)
        engine.add_request(Request(f"warmup-r{rank}", [1] * 8, sampling, name))
        while engine.has_unfinished:
            engine.step()
        engine.unload_adapter(name)
    return engine


def measure(
    engine: Orchestrator, workload: MultiTurnWorkload, encode: Callable[[str], list[int]]
) -> tuple[dict[str, Any], dict[str, TurnRecord]]:
    """Replay `workload` on a warmed engine: its row (`summarize`) and the records."""
    samples: list[CacheStats] = []

    def sample() -> None:
        cache = engine.stats().cache
        assert cache is not None
        samples.append(cache)

    before = engine.stats()
    records, makespan = replay(engine, workload, encode, on_step=sample)
    return summarize(records, makespan, samples, before, engine.stats()), records


def run_policy(
    loaded: LoadedModel,
    plan: Plan,
    policy: str,
    workload: MultiTurnWorkload,
    adapter_paths: list[Path],
) -> tuple[dict[str, Any], dict[str, TurnRecord]]:
    """Build and warm an engine for `policy`, measure it, close it."""
    assert loaded.tokenizer is not None
    started = time.monotonic()
    engine = build(loaded, plan, policy, adapter_paths)
    warmup_s = time.monotonic() - started
    try:
        row, records = measure(engine, workload, loaded.tokenizer.encode)
    finally:
        engine.close()
    return row | {"warmup_s": warmup_s}, records


def compare(plan: Plan, loaded: LoadedModel) -> tuple[MultiTurnWorkload, list[dict[str, Any]]]:
    """The workload and one row per policy, with its mismatches against the first."""
    assert loaded.tokenizer is not None
    workload = make_workload(plan, loaded.tokenizer)
    print(describe(workload), file=sys.stderr, flush=True)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_demo_adapters(
            loaded.config, tmp, n=plan.adapters, ranks=plan.ranks, seed=plan.seed
        )
        reference: dict[str, TurnRecord] | None = None
        for policy in plan.policies:
            row, records = run_policy(loaded, plan, policy, workload, paths)
            reference = records if reference is None else reference
            row |= {
                "mismatched_turns": len(mismatches(reference, records)),
                "divergences": divergences(reference, records),
            }
            print(
                f"{policy}: warm-up {row['warmup_s']:.0f} s, replay {row['makespan_s']:.0f} s\n"
                + _row_line(row),
                file=sys.stderr,
                flush=True,
            )
            rows.append(row)
    return workload, rows


# -- the report --------------------------------------------------------------------------


def describe(workload: MultiTurnWorkload) -> str:
    meta, sessions = workload.meta, workload.sessions()
    lengths = [len(turns) for turns in sessions.values()]
    span = workload.turns[-1].arrival_s if workload.turns else 0.0
    return (
        f"{meta['turns']} turns in {meta['sessions']} sessions (1-{max(lengths, default=0)} "
        f"turns, mean {np.mean(lengths) if lengths else 0:.1f}), trace arrivals over "
        f"{span:.0f} s, prompts up to {meta['longest_context_tokens']} tokens"
    )


def _row_line(row: dict[str, Any]) -> str:
    shares = (row[key] for key in ("kv_running_share", "kv_cached_share", "lora_share"))
    return (
        f"| {row['policy']} | {row['mean_ttft_s']:.2f} | {row['p90_ttft_s']:.2f} | "
        f"{row['mean_tpot_s'] * 1e3:.0f} | {row['hit_rate']:.0%} | "
        + " / ".join(f"{share:.0%}" for share in shares)
        + f" | {row['swaps_out']} / {row['swaps_in']} | {row['max_invalid_kv_pages']} | "
        f"{row['adapter_loads']} | {row['adapter_wait_s']:.2f} | "
        f"{row['throughput_tokens_per_s']:.1f} | "
        f"{row['mismatched_turns']} |"
    )


def render(
    facts: dict[str, Any], plan: Plan, workload: MultiTurnWorkload, rows: list[dict[str, Any]]
) -> str:
    meta = workload.meta
    lines = [
        f"# FastLibra on jlora: cache policies on a multi-turn workload ({facts['date'][:10]})",
        "",
        f"{plan.model} fp32 | {facts['device']} | {facts['cpu_count']} CPUs "
        f"({facts['cpu_model']}) | jax {facts['jax']} ({facts['jax_backend']}) | "
        f"1-min load avg {facts['load_avg_1min_start']:.1f} at start",
        "",
        f"Workload: {describe(workload)}; Azure `{meta['trace']}` trace arrivals at "
        f"{plan.rate_scale:g}x, a session continued with probability {plan.continue_p:g}, "
        f"geometric length of mean {plan.mean_turns:g} turns, messages "
        f"{plan.message_tokens[0]}-{plan.message_tokens[1]} tokens, answers "
        f"{plan.output_tokens[0]}-{plan.output_tokens[1]} tokens (greedy, EOS ignored), "
        f"think time {plan.think_s:g} s; sessions over {plan.adapters} adapters of ranks "
        f"{', '.join(map(str, plan.ranks))} (Zipf {plan.zipf_s:g}, base model "
        f"{plan.base_fraction:.0%}).",
        "",
        f"Engine: {plan.slots} decode rows, max_seq_len {plan.max_seq_len}, adapters "
        f"loaded on demand into {plan.max_loras} slots (lru's static share) or into the "
        f"pool's pages (fastlibra, none: the pool decides), a device pool of "
        f"{plan.pool_blocks} KV blocks ({rows[0]['pool_pages'] if rows else plan.pool_blocks} "
        "pages), a host pool of "
        f"{plan.host_pool_mib} MiB, an emulated link of {plan.link_gbps:g} GB/s.",
        "",
        "Pool use is the mean share of the device pool's pages over the engine's steps: "
        "running KV / cached (history) KV / adapters. Invalid KV: the most device KV pages "
        "seen whose adapter was off the device. Adapter wait: the seconds a turn waited, "
        "queued, for its adapter to be on the device (the mean over turns). Mismatched "
        f"turns: turns whose tokens differ from {plan.policies[0]}'s.",
        "",
        "| policy | TTFT mean (s) | TTFT P90 (s) | TPOT (ms) | hit rate | pool use | "
        "swaps out / in | invalid KV | adapter loads | adapter wait (s) | tokens/s | "
        "mismatched turns |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|",
        *(_row_line(row) for row in rows),
    ]
    return "\n".join(lines) + "\n"


# The default chat scenario; one where adapters compete for the pool: twice the
# adapters, flatter popularity, a slower link (loads and swaps cost 4x as much); and one
# where they also compete for lru's slots: twice the decode rows of its max_loras, twice
# the arrival rate, and a host pool too small to keep all history (FastLibra §5.1's case).
SCENARIOS = {
    "chat": Plan(),
    "many-adapters": dataclasses.replace(Plan(), adapters=16, zipf_s=0.5, link_gbps=0.25),
    "contention": dataclasses.replace(
        Plan(),
        adapters=16,
        zipf_s=0.5,
        link_gbps=0.25,
        slots=8,
        host_pool_mib=64,
        rate_scale=0.8,
        turns=96,
    ),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="16 short turns, a smoke run")
    parser.add_argument("--scenario", choices=SCENARIOS, default="chat", help="the setup")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results directory")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else SCENARIOS[args.scenario]
    _persistent_compilation_cache()
    facts = machine_facts()
    loaded = load_model(plan.model)
    workload, rows = compare(plan, loaded)
    args.out.mkdir(parents=True, exist_ok=True)
    name = "cpu-cache" if args.scenario == "chat" else f"cpu-cache-{args.scenario}"
    stem = dated_stem(args.out, name)
    (args.out / f"{stem}.md").write_text(render(facts, plan, workload, rows))
    write_report(args.out / f"{stem}.json", facts, plan, rows, workload=workload.meta)
    print(render(facts, plan, workload, rows))


def _persistent_compilation_cache() -> None:
    """The three engines compile the same programs: the second and third load them from
    XLA's disk cache (the CLI's, `JLORA_COMPILATION_CACHE`)."""
    import jax

    default = os.path.join(os.path.expanduser("~"), ".cache", "jlora", "xla")
    cache_dir = os.environ.get("JLORA_COMPILATION_CACHE", default)
    if cache_dir:
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


if __name__ == "__main__":
    main()
