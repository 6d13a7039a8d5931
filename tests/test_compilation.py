"""After warm-up, a run with requests arriving and leaving compiles nothing."""

from __future__ import annotations

import numpy as np
import pytest
from jax import monitoring

from configs import bucket
from configs.engine import CACHE_POLICIES
from jlora.engine.api import Request, SamplingParams
from tests.engine_helpers import make_engine

_EVENTS: list[str] = []
_COUNTING = [False]


def _listener(name: str, duration: float, **_) -> None:
    if _COUNTING[0] and name in (
        "/jax/core/compile/jaxpr_trace_duration",
        "/jax/core/compile/backend_compile_duration",
    ):
        _EVENTS.append(name)


monitoring.register_event_duration_secs_listener(_listener)


def test_listener_counts_compilations(tiny):
    """Guard for the test below: a fresh engine without warm-up must be seen compiling."""
    engine = make_engine(tiny, max_slots=2, max_seq_len=64, min_bucket=16)
    _EVENTS.clear()
    _COUNTING[0] = True
    try:
        engine.add_request(Request("r", [1, 2, 3], SamplingParams(max_tokens=2)))
        while engine.has_unfinished:
            engine.step()
    finally:
        _COUNTING[0] = False
    assert _EVENTS


@pytest.mark.parametrize(
    "lora", [None, "reference", "bgmv", "mbgmv"], ids=["base", "reference", "bgmv", "mbgmv"]
)
def test_no_compilation_after_warmup(tiny, tmp_path, lora):
    """With LoRA, three adapters share two device slots: the run loads, evicts and
    mixes adapters with base rows, and still compiles nothing. The base model and the
    reference backend decode in row buckets of 1 and 3 as the batch fills and drains.
    The Pallas backends, whose interpreted kernels compile slowly, run a context of 64
    (prefill buckets 16-64), the others 128."""
    context = 64 if lora in ("bgmv", "mbgmv") else 128
    if lora:
        from jlora.adapters.peft import make_demo_adapters

        paths = make_demo_adapters(tiny.config, tmp_path, n=3, ranks=[4, 8, 16])
        engine = make_engine(
            tiny,
            max_slots=3,
            max_seq_len=context,
            min_bucket=16,
            max_loras=2,
            max_lora_rank=16,
            lora_backend=lora,
            cache_policy="lru",  # vLLM's static share: two slots for three adapters, evicting
            decode_row_buckets=(1, 3) if lora == "reference" else (3,),  # Pallas: slow compiles
        )
        for path in paths:
            engine.register_adapter(path.name, str(path))
        adapters = [path.name for path in paths] + [None]
    else:
        engine = make_engine(
            tiny, max_slots=3, max_seq_len=128, min_bucket=16, decode_row_buckets=(1, 3)
        )
        adapters = [None]
    engine.warmup()
    rng = np.random.default_rng(0)
    # (arrival step, prompt length, max_tokens, sampling) — lengths cover every prefill
    # bucket, sequences grow across decode buckets, slots fill, empty and refill.
    plan = {
        128: [
            (0, 5, 20, 0.0),
            (0, 16, 3, 0.7),
            (1, 33, 40, 0.0),
            (2, 100, 20, 1.0),
            (4, 70, 9, 0.0),
            (9, 1, 60, 0.9),
            (30, 17, 5, 0.0),
            (31, 127, 1, 0.0),
        ],
        64: [
            (0, 5, 20, 0.0),
            (0, 16, 3, 0.7),
            (1, 33, 20, 0.0),
            (2, 50, 10, 1.0),
            (4, 35, 9, 0.0),
            (9, 1, 40, 0.9),
            (30, 17, 5, 0.0),
            (31, 63, 1, 0.0),
        ],
    }[context]
    _EVENTS.clear()
    _COUNTING[0] = True
    finished, step = 0, 0
    try:
        while finished < len(plan):
            for i, (arrival, length, max_tokens, temperature) in enumerate(plan):
                if arrival == step:
                    engine.add_request(
                        Request(
                            f"r{i}",
                            rng.integers(0, 512, length).tolist(),
                            SamplingParams(
                                max_tokens=max_tokens,
                                temperature=temperature,
                                top_k=20 if temperature else 0,
                                seed=i,
                                ignore_eos=True,
                            ),
                            adapter=adapters[i % len(adapters)],
                        )
                    )
            if step == 12:
                engine.abort("r2")
                finished += 1
            finished += sum(e.finish_reason is not None for e in engine.step())
            step += 1
    finally:
        _COUNTING[0] = False
    assert _EVENTS == []
    if lora:
        assert engine.adapters.slots.stats()["evictions"] >= 1
    # Each prefill bucket three times: plain, continuing a cached prefix (the prefix
    # cache), and packed (prefill_many: every bucket here is within packed_prefill_tokens);
    # each decode bucket once per row bucket.
    config = engine.config
    assert engine.device.steps.num_compiles == 3 * len(config.prefill_buckets) + len(
        config.decode_buckets
    ) * len(config.decode_row_buckets)


def test_on_demand_warmup_compiles_only_the_shapes_a_run_meets(tiny, caplog):
    """`warmup(on_demand=True)` (the one-shot CLI's) compiles nothing ahead; a run then
    compiles exactly the shapes it meets, once each, quietly (no warning), and samples
    the same tokens as an engine warmed ahead."""
    requests = [
        Request("a", list(range(1, 6)), SamplingParams(max_tokens=6, ignore_eos=True)),
        Request("b", list(range(3, 40)), SamplingParams(max_tokens=4, ignore_eos=True)),
    ]

    def run(engine) -> dict[str, list[int]]:
        tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
        for request in requests:
            engine.add_request(request)
        while engine.has_unfinished:
            for event in engine.step():
                tokens[event.request_id].append(event.token_id)
        return tokens

    ahead = make_engine(tiny, max_slots=2, max_seq_len=256, min_bucket=16)
    ahead.warmup()
    lazy = make_engine(tiny, max_slots=2, max_seq_len=256, min_bucket=16)
    lazy.warmup(on_demand=True)
    steps = lazy.device.steps
    assert steps.num_compiles == 0
    with caplog.at_level("INFO", logger="jlora.device.steps"):
        assert run(lazy) == run(ahead)
    # Packed together (5 + 37 tokens); decoded together (rows up to 41 tokens long),
    # then "a" alone (up to 11): nothing cached, no other bucket.
    config = lazy.device.config
    assert list(steps._prefill_packed_exe) == [
        (bucket(config.prefill_buckets, 42), lazy.device.packed_prefill_prompts)
    ]
    assert sorted(steps._decode_exe, key=lambda shape: shape[1]) == [
        (2, bucket(config.decode_buckets, n) // config.block_size) for n in (11, 41)
    ]
    assert steps.num_compiles == 3 < ahead.device.steps.num_compiles
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    assert len([r for r in caplog.records if r.getMessage().startswith("compiled")]) == 3


def test_warmup_compiles_no_prefill_above_the_budget_and_chunks_need_none(tiny):
    """A step prefills at most prefill_token_budget tokens (chunked prefill), so warm-up
    stops at its bucket; a prompt five times longer then runs without compiling."""
    engine = make_engine(tiny, max_slots=2, max_seq_len=256, min_bucket=16, prefill_token_budget=32)
    engine.warmup()
    steps = engine.device.steps
    assert max(steps._prefill_exe) == max(steps._prefill_cached_exe) == 32
    _EVENTS.clear()
    _COUNTING[0] = True
    try:
        engine.add_request(Request("long", list(range(1, 161)), SamplingParams(max_tokens=3)))
        while engine.has_unfinished:
            engine.step()
    finally:
        _COUNTING[0] = False
    assert _EVENTS == []
    assert engine.stats().prefill_chunks == 4


@pytest.mark.parametrize("policy", CACHE_POLICIES)
def test_warmup_for_given_prompts_leaves_no_compile_to_chunks_or_prefix_hits(tiny, policy):
    """Warmed up for prompts of 100 and 29 tokens: run together under a 32-token budget,
    they prefill in chunks of other buckets than their own, each chunk after the first
    continuing a prefix; the 100-token prompt again then hits the prefix cache (but under
    "none") and prefills only its tail. Nothing compiles."""
    engine = make_engine(
        tiny, max_slots=2, max_seq_len=256, min_bucket=16, prefill_token_budget=32,
        cache_policy=policy,
    )  # fmt: skip
    long, short = list(range(1, 101)), list(range(200, 229))
    engine.warmup(prompt_lengths=[len(long), len(short)], max_length=110)
    _EVENTS.clear()
    _COUNTING[0] = True
    try:
        for batch in ((("long", long), ("short", short)), (("again", long),)):
            for rid, prompt in batch:
                engine.add_request(Request(rid, prompt, SamplingParams(max_tokens=4)))
            while engine.has_unfinished:
                engine.step()
    finally:
        _COUNTING[0] = False
    assert _EVENTS == []
    assert engine.stats().prefill_chunks >= 3
