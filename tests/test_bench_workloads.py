"""bench.workloads: seeded generators, the JSONL file and its validation, Zipf adapter
popularity, the Azure trace replayed as it is (arrivals and lengths computed here again
from the CSV, independently), and prompts of an exact token length under SmolLM2's
tokenizer (loaded from the GGUF metadata alone, about a second)."""

from __future__ import annotations

import collections
import csv
import itertools
import json
import re
import time

import numpy as np
import pytest

from bench.lib.workloads import (
    DATA_DIR,
    REQUEST_KEYS,
    PromptSynthesizer,
    WordTokenizer,
    Workload,
    WorkloadError,
    assign_adapters,
    azure_workload,
    demo_adapter_pool,
    load_tokenizer,
    multiturn_workload,
    poisson_workload,
    synth_prompt,
    zipf_weights,
)
from bench.workloads import main
from configs import load_preset
from jlora.adapters.peft import make_demo_adapters
from jlora.contract.peft import read_adapter_config
from jlora.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer("smollm2-135m")


def small_poisson(tokenizer, **options) -> Workload:
    defaults = dict(
        rate_per_s=10.0,
        num_requests=40,
        prompt_tokens=(4, 40),
        output_tokens=(1, 32),
        adapters=demo_adapter_pool(4),
        base_fraction=0.25,
        seed=7,
        tokenizer=tokenizer,
    )
    return poisson_workload(**{**defaults, **options})


def trace_rows(trace: str, count: int) -> list[tuple[np.datetime64, int, int]]:
    """The first `count` rows of the CSV: (timestamp at ns precision, context, generated)."""
    with (DATA_DIR / f"{trace}.csv").open(newline="") as handle:
        rows = list(csv.reader(handle))[1 : count + 1]
    return [(np.datetime64(t.replace(" ", "T"), "ns"), int(c), int(g)) for t, c, g in rows]


# -- determinism and the file --------------------------------------------------------


def test_the_same_seed_gives_the_same_workload(tokenizer):
    assert small_poisson(tokenizer) == small_poisson(tokenizer)
    other = small_poisson(tokenizer, seed=8)
    assert [r.arrival_s for r in other.requests] != [
        r.arrival_s for r in small_poisson(tokenizer).requests
    ]
    azure = dict(trace="conv", max_requests=30, prompt_tokens=(1, 64), tokenizer=tokenizer)
    assert azure_workload(**azure) == azure_workload(**azure)


def test_the_adapter_pool_does_not_change_arrivals_or_prompts(tokenizer):
    one = small_poisson(tokenizer, adapters=demo_adapter_pool(2))
    two = small_poisson(tokenizer, adapters=demo_adapter_pool(9), base_fraction=0.5)
    assert [(r.arrival_s, r.prompt, r.max_tokens) for r in one.requests] == [
        (r.arrival_s, r.prompt, r.max_tokens) for r in two.requests
    ]


def test_save_and_load_round_trip(tokenizer, tmp_path):
    workload = small_poisson(tokenizer)
    path = workload.save(tmp_path / "w.jsonl")
    lines = path.read_text().splitlines()
    header = json.loads(lines[0])
    assert header["format"] == "jlora-workload" and header["version"] == 1
    assert header["meta"]["kind"] == "poisson" and header["meta"]["seed"] == 7
    assert len(lines) == 1 + len(workload.requests)
    assert all(tuple(json.loads(line)) == REQUEST_KEYS for line in lines[1:])
    assert Workload.load(path) == workload


BAD_LINES = [
    ({"max_tokens": 0}, "max_tokens=0"),
    ({"arrival_s": "soon"}, "arrival_s='soon'"),
    ({"arrival_s": -1.0}, "arrival_s=-1.0"),
    ({"prompt": ""}, "prompt=''"),
    ({"prompt_tokens": 2.5}, "prompt_tokens=2.5"),
    ({"adapter": None, "rank": 8}, "rank=8"),
    ({"adapter": "demo-00-r8", "rank": 0}, "rank=0"),
    ({"adapter": 3}, "adapter=3"),
    ({"id": "r0"}, "id='r0' is used twice"),
    ({"temperature": 0.5}, "unknown fields temperature"),
]


@pytest.mark.parametrize("change, names", BAD_LINES)
def test_a_bad_request_line_names_its_line_and_field(tokenizer, tmp_path, change, names):
    path = small_poisson(tokenizer, num_requests=3).save(tmp_path / "w.jsonl")
    lines = path.read_text().splitlines()
    lines[2] = json.dumps({**json.loads(lines[2]), **change})  # the second request
    path.write_text("\n".join(lines))
    with pytest.raises(WorkloadError, match=f"w.jsonl:3: .*{re.escape(names)}"):
        Workload.load(path)


def test_missing_fields_broken_json_and_a_wrong_header_are_named(tokenizer, tmp_path):
    path = small_poisson(tokenizer, num_requests=2).save(tmp_path / "w.jsonl")
    header, first, second = path.read_text().splitlines()
    cases = [
        ([header, first, json.dumps({k: v for k, v in json.loads(second).items() if k != "rank"})],
         "w.jsonl:3: missing fields rank "),
        ([header, "{not json", second], "w.jsonl:2: not JSON"),
        ([header, "[1, 2]", second], "w.jsonl:2: expected a JSON object"),
        ([json.dumps({"format": "other", "version": 1, "meta": {}}), first],
         "w.jsonl:1: format='other'"),
    ]  # fmt: skip
    for lines, message in cases:
        path.write_text("\n".join(lines))
        with pytest.raises(WorkloadError, match=message):
            Workload.load(path)


# -- adapters ------------------------------------------------------------------------


def test_the_demo_pool_is_what_make_demo_adapters_writes(tmp_path):
    paths = make_demo_adapters(load_preset("cpu-tiny").config, tmp_path, n=5, ranks=[4, 8])
    pool = demo_adapter_pool(5, (4, 8))
    assert [path.name for path in paths] == [name for name, _ in pool]
    assert [read_adapter_config(path).rank for path in paths] == [rank for _, rank in pool]
    assert pool[:3] == [("demo-00-r4", 4), ("demo-01-r8", 8), ("demo-02-r4", 4)]


@pytest.mark.parametrize("zipf_s, base_fraction", [(1.0, 0.2), (1.5, 0.0), (0.0, 0.5)])
def test_adapter_shares_follow_zipf_and_the_base_fraction(zipf_s, base_fraction):
    pool = demo_adapter_pool(5)
    count = 40_000
    picks = assign_adapters(
        count,
        pool,
        zipf_s=zipf_s,
        base_fraction=base_fraction,
        rng=np.random.default_rng(0),
    )
    shares = {name: 0 for name, _ in pool} | {None: 0}
    for adapter, rank in picks:
        shares[adapter] += 1
        assert rank == (0 if adapter is None else dict(pool)[adapter])
    # Each share is within 5 binomial standard deviations (at most 0.0125 here) of
    # (1 - base_fraction) * k**-s / sum_j j**-s, e.g. 0.8 * 0.438 = 0.350 for s = 1.
    expected = {None: base_fraction} | {
        name: (1 - base_fraction) * weight
        for (name, _), weight in zip(pool, zipf_weights(len(pool), zipf_s), strict=True)
    }
    for name, share in expected.items():
        tolerance = 5 * np.sqrt(share * (1 - share) / count)
        assert abs(shares[name] / count - share) <= tolerance, (name, shares[name] / count, share)
    if zipf_s > 0:
        adapter_counts = [shares[name] for name, _ in pool]
        assert adapter_counts == sorted(adapter_counts, reverse=True)


def test_a_workload_carries_the_adapter_mix(tokenizer):
    workload = small_poisson(tokenizer, num_requests=2000, prompt_tokens=(2, 4))
    base = sum(r.adapter is None for r in workload.requests) / 2000
    assert abs(base - 0.25) < 5 * np.sqrt(0.25 * 0.75 / 2000)
    assert {r.adapter for r in workload.requests} == {None} | {n for n, _ in demo_adapter_pool(4)}
    assert workload.meta["adapters"] == [list(pair) for pair in demo_adapter_pool(4)]
    assert small_poisson(tokenizer, adapters=[]).requests[0].adapter is None


# -- generators ----------------------------------------------------------------------


def test_poisson_arrivals_and_lengths(tokenizer):
    workload = poisson_workload(
        rate_per_s=50.0,
        duration_s=40.0,
        prompt_tokens=(3, 6),
        output_tokens=(10, 12),
        tokenizer=tokenizer,
    )
    arrivals = np.array([r.arrival_s for r in workload.requests])
    # 2000 expected; a Poisson count's standard deviation is sqrt(2000) = 45.
    assert abs(len(arrivals) - 2000) < 5 * 45
    assert np.all(np.diff(arrivals) >= 0) and arrivals[-1] < 40.0
    assert abs(np.diff(arrivals).mean() - 1 / 50) < 0.002
    assert {r.max_tokens for r in workload.requests} == {10, 11, 12}
    assert {r.prompt_tokens for r in workload.requests} == {3, 4, 5, 6}
    with pytest.raises(WorkloadError, match="give exactly one"):
        poisson_workload(rate_per_s=1.0, tokenizer=tokenizer)


@pytest.mark.parametrize("trace, start_s, rate_scale", [("code", 0.0, 2.5), ("conv", 100.0, 1.0)])
def test_azure_arrivals_are_the_trace_s_divided_by_rate_scale(
    tokenizer, trace, start_s, rate_scale
):
    rows = trace_rows(trace, 1000)
    seconds = np.array([(t - rows[0][0]) / np.timedelta64(1, "ns") / 1e9 for t, _, _ in rows])
    first = int(np.argmax(seconds >= start_s))  # the first request in the window
    workload = azure_workload(
        trace=trace,
        start_s=start_s,
        rate_scale=rate_scale,
        max_requests=40,
        prompt_tokens=(1, 16),
        output_tokens=(1, 16),
        tokenizer=tokenizer,
    )
    arrivals = np.array([r.arrival_s for r in workload.requests])
    expected = (seconds[first : first + 40] - start_s) / rate_scale
    np.testing.assert_allclose(arrivals, expected, rtol=0, atol=1e-6)
    assert workload.meta["first_trace_row"] == first


def test_azure_lengths_are_scaled_and_clipped(tokenizer):
    rows = trace_rows("code", 60)
    workload = azure_workload(
        trace="code",
        duration_s=30.0,
        prompt_scale=0.1,
        output_scale=3.0,
        prompt_tokens=(40, 300),
        output_tokens=(20, 64),
        tokenizer=tokenizer,
    )
    count = len(workload.requests)
    assert count == sum((t - rows[0][0]) < np.timedelta64(30, "s") for t, _, _ in rows)
    prompts = [min(max(round(c * 0.1), 40), 300) for _, c, _ in rows[:count]]
    outputs = [min(max(round(g * 3.0), 20), 64) for _, _, g in rows[:count]]
    assert [r.prompt_tokens for r in workload.requests] == prompts
    assert [r.max_tokens for r in workload.requests] == outputs
    assert 40 in prompts and 300 in prompts and 64 in outputs  # both bounds were hit
    assert all(len(tokenizer.encode(r.prompt)) == r.prompt_tokens for r in workload.requests)
    assert workload.meta["prompt_scale"] == 0.1 and workload.meta["output_tokens"] == [20, 64]


def test_azure_refuses_a_bad_parameter_by_name(tokenizer, tmp_path):
    with pytest.raises(WorkloadError, match="rate_scale=0"):
        azure_workload(rate_scale=0, tokenizer=tokenizer)
    with pytest.raises(WorkloadError, match="trace='chat'"):
        azure_workload(trace="chat", tokenizer=tokenizer)
    with pytest.raises(WorkloadError, match="code.csv: no such file"):
        azure_workload(data_dir=tmp_path, tokenizer=tokenizer)


# -- prompts -------------------------------------------------------------------------


def test_prompts_have_exactly_the_asked_token_count(tokenizer):
    synth = PromptSynthesizer(tokenizer)
    for seed in range(2):
        rng = np.random.default_rng(seed)
        for n_tokens in range(1, 301):
            prompt, length = synth.make(n_tokens, rng)
            assert length == len(tokenizer.encode(prompt)) == n_tokens, (seed, n_tokens)
    first = synth_prompt(tokenizer, 50, np.random.default_rng(3))
    assert first == synth_prompt(tokenizer, 50, np.random.default_rng(3))
    assert first != synth_prompt(tokenizer, 50, np.random.default_rng(4))


def test_a_bos_counts_and_one_token_is_out_of_reach(tokenizer):
    with_bos = Tokenizer(tokenizer.backend, bos_id=1, eos_ids=[2], add_bos=True, chat_template=None)
    synth = PromptSynthesizer(with_bos)
    rng = np.random.default_rng(0)
    for n_tokens in (2, 3, 17, 200):
        prompt, length = synth.make(n_tokens, rng)
        assert length == len(with_bos.encode(prompt)) == n_tokens
        assert with_bos.encode(prompt)[0] == 1
    assert synth.make(1, rng)[1] == 2  # a BOS and one word: the closest there is


def test_prompt_synthesis_is_fast(tokenizer):
    """Thousands of prompts of a few hundred tokens take seconds (about a second here)."""
    rng, synth = np.random.default_rng(0), PromptSynthesizer(tokenizer)
    start = time.perf_counter()
    lengths = [synth.make(int(n), rng)[1] for n in rng.integers(100, 400, 2000)]
    assert time.perf_counter() - start < 10
    assert len(lengths) == 2000


# -- multi-turn sessions -------------------------------------------------------------


def small_multiturn(tokenizer, **options):
    defaults = dict(
        trace="conv",
        max_turns=120,
        rate_scale=2.0,
        message_scale=0.05,
        output_scale=0.1,
        message_tokens=(4, 40),
        output_tokens=(2, 16),
        continue_p=0.7,
        mean_turns=4.0,
        max_context_tokens=200,
        think_s=0.5,
        adapters=demo_adapter_pool(4, (8, 16)),
        base_fraction=0.2,
        seed=3,
        tokenizer=tokenizer,
    )
    return multiturn_workload(**{**defaults, **options})


def test_a_session_s_turns_extend_its_previous_prompt(tokenizer):
    workload = small_multiturn(tokenizer)
    sessions = workload.sessions()
    assert sum(len(turns) for turns in sessions.values()) == len(workload.turns) == 120
    assert workload.meta["sessions"] == len(sessions) and workload.think_s == 0.5
    assert max(len(turns) for turns in sessions.values()) > 1
    for name, turns in sessions.items():
        assert [turn.index for turn in turns] == list(range(len(turns)))
        assert [turn.id for turn in turns] == [f"{name}-t{k}" for k in range(len(turns))]
        assert turns[0].context_tokens == turns[0].message_tokens
        # Turn k's prompt: turn k-1's prompt, its answer (max_tokens), the new message.
        for before, turn in itertools.pairwise(turns):
            expected = before.context_tokens + before.max_tokens + turn.message_tokens
            assert turn.context_tokens == expected
            assert turn.arrival_s >= before.arrival_s
        assert turns[-1].context_tokens + turns[-1].max_tokens <= 200
        for turn in turns:
            assert len(tokenizer.encode(turn.message)) == turn.message_tokens
    assert workload.meta["longest_context_tokens"] == max(
        turn.context_tokens for turn in workload.turns
    )


def test_a_session_keeps_one_adapter_drawn_with_zipf_popularity(tokenizer):
    workload = small_multiturn(tokenizer, max_turns=None, duration_s=600.0, continue_p=0.5)
    pool = dict(demo_adapter_pool(4, (8, 16)))
    firsts = [turns[0] for turns in workload.sessions().values()]
    for turns in workload.sessions().values():
        assert {(turn.adapter, turn.rank) for turn in turns} == {(turns[0].adapter, turns[0].rank)}
    for turn in firsts:
        assert turn.rank == (0 if turn.adapter is None else pool[turn.adapter])
    counts = collections.Counter(turn.adapter for turn in firsts)
    # Hundreds of sessions: the base model near 20%, adapters in Zipf order.
    assert len(firsts) > 300
    assert abs(counts[None] / len(firsts) - 0.2) < 5 * np.sqrt(0.2 * 0.8 / len(firsts))
    ranked = [counts[name] for name in pool]
    assert ranked == sorted(ranked, reverse=True) and ranked[-1] > 0


def test_turns_are_the_trace_window_s_arrivals_and_lengths(tokenizer):
    workload = small_multiturn(tokenizer)
    window = azure_workload(
        trace="conv",
        max_requests=120,
        rate_scale=2.0,
        prompt_scale=0.05,
        output_scale=0.1,
        prompt_tokens=(4, 40),
        output_tokens=(2, 16),
        seed=3,
        tokenizer=tokenizer,
    )
    assert [(t.arrival_s, t.message, t.max_tokens) for t in workload.turns] == [
        (r.arrival_s, r.prompt, r.max_tokens) for r in window.requests
    ]
    arrivals = [turn.arrival_s for turn in workload.turns]
    assert arrivals == sorted(arrivals)


def test_sessions_close_after_their_turns_or_at_the_context_limit(tokenizer):
    alone = small_multiturn(tokenizer, continue_p=0.0)
    assert all(turn.index == 0 for turn in alone.turns)
    assert alone.meta["sessions"] == len(alone.turns)
    # Sessions that would run forever (mean 1000 turns) end only at the context limit.
    long = small_multiturn(tokenizer, continue_p=0.9, mean_turns=1000.0, max_context_tokens=120)
    ended = list(long.sessions().values())[:-3]  # the last ones may still be open
    assert all(turns[-1].context_tokens + turns[-1].max_tokens <= 120 for turns in ended)
    assert max(len(turns) for turns in ended) > 2


def test_multiturn_workloads_are_seeded(tokenizer):
    assert small_multiturn(tokenizer) == small_multiturn(tokenizer)
    other = small_multiturn(tokenizer, seed=4)
    assert [t.session for t in other.turns] != [t.session for t in small_multiturn(tokenizer).turns]
    # Another adapter pool: the same sessions and messages.
    pool = small_multiturn(tokenizer, adapters=demo_adapter_pool(9), base_fraction=0.0)
    assert [(t.id, t.message, t.context_tokens) for t in pool.turns] == [
        (t.id, t.message, t.context_tokens) for t in small_multiturn(tokenizer).turns
    ]
    assert all(turn.adapter is not None for turn in pool.turns)


@pytest.mark.parametrize(
    "change, names",
    [
        ({"continue_p": 1.0}, "continue_p=1.0"),
        ({"continue_p": -0.5}, "continue_p=-0.5"),
        ({"mean_turns": 0.5}, "mean_turns=0.5"),
        ({"think_s": -1.0}, "think_s=-1.0"),
        ({"max_context_tokens": 50}, "max_context_tokens=50"),
        ({"max_turns": -1}, "max_turns=-1"),
        ({"message_tokens": (0, 8)}, "message_tokens=(0, 8)"),
        ({"rate_scale": 0}, "rate_scale=0"),
        ({"zipf_s": -1.0}, "zipf_s=-1.0"),
        ({"trace": "chat"}, "trace='chat'"),
    ],
)
def test_multiturn_refuses_a_bad_parameter_by_name(tokenizer, change, names):
    with pytest.raises(WorkloadError, match=re.escape(names)):
        small_multiturn(tokenizer, **change)


# -- CLI -----------------------------------------------------------------------------


def test_the_cli_writes_a_workload_and_summarizes_it(tmp_path, capsys):
    out = tmp_path / "w.jsonl"
    main(["azure", "--trace", "code", "--duration", "20", "--rate-scale", "2", "--prompt-tokens",
          "8,64", "--adapters", "3", "--base-fraction", "0.5", "--out", str(out)])  # fmt: skip
    printed = capsys.readouterr().out
    workload = Workload.load(out)
    assert f"azure: {len(workload.requests)} requests" in printed
    assert "(base)" in printed and "written to" in printed
    assert workload.meta["tokenizer"] == "smollm2-135m"
    assert workload.meta["rate_scale"] == 2.0 and workload.meta["duration_s"] == 20.0
    assert {r.adapter for r in workload.requests} <= {None, "demo-00-r8", "demo-01-r16",
                                                      "demo-02-r32"}  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        main(["poisson", "--rate", "0", "--num-requests", "3", "--out", str(out)])
    assert exit_info.value.code == 2
    assert "rate_per_s=0.0 must be a positive number" in capsys.readouterr().err


def test_word_tokenizer_prompts_are_exact_and_foreign_words_are_refused():
    words = WordTokenizer()
    for length in (1, 7, 300):
        text, reached = PromptSynthesizer(words).make(length, np.random.default_rng(length))
        assert reached == length == len(words.encode(text))
        assert words.decode(words.encode(text)) == text
    with pytest.raises(WorkloadError, match="'zebra' is not one of WORDS"):
        words.encode("the zebra")
