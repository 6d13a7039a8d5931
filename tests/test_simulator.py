"""The cluster simulator (`bench.simulator`) on hand-computed cases.

A two-instance run under most-idle, every routing choice, iteration and token time
worked out in comments and compared exactly; rank-aware's SLO check steering requests
on a second small case; the policies are the router's own objects; SLO attainment,
the JSON rows' keys and determinism under a seed.
"""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

import router.app
from bench import simulator
from bench.lib import cluster
from bench.lib.cluster import InstanceConfig, Request, RunResult, simulate
from router.perf_model import PerfModel, PerfProfile, rank_feature
from router.policies import (
    POLICIES,
    FirstFit,
    MostIdle,
    RandomChoice,
    RankAware,
    ShortestPending,
)

# PrePerf(S) = 20 + Σ prompt tokens ms (no rank term); DecPerf(S) = α·|S|·max rank + 10 ms.
# SLO = 1.5 x DecPerf(no adapter) = 1.5 x 10 = 15 ms.
PREFILL = PerfModel("bgmv", alpha=0.0, beta=20.0, gamma=1.0)


def _profile(alpha: float) -> PerfProfile:
    return PerfProfile(PREFILL, PerfModel("bgmv", alpha=alpha, beta=10.0))


def _request(arrival: float, prompt: int, output: int, adapter: str, rank: int) -> Request:
    return Request(arrival, prompt, output, adapter, rank)


# -- the two-instance case, most-idle ----------------------------------------------------
#
# Profile: α = 0.5. Instances A (instance-00) and B (instance-01): 2 decode slots, a
# rank-r adapter loads in r ms (one copy at a time per instance), nothing resident.
#
#   r0: t=0, prompt 10, 3 tokens, adapter a (rank 2)
#   r1: t=5, prompt 10, 2 tokens, adapter b (rank 4)
#   r2: t=6, prompt 20, 2 tokens, adapter a (rank 2)
#
# most-idle: fewest requests (running + queued), then most free slots, then first.
#  t=0  r0: A and B empty -> A. A copies a: 0..2.
#  t=2  a on A; A prefills r0: 20 + 10 = 30 ms -> 32 (r0 holds a slot: running (2,)).
#  t=5  r1: A 1 request, B 0 -> B. B copies b: 5..9.
#  t=6  r2: A 1 request (1 free slot), B 1 (r1 queued, 2 free) -> B. B's link is busy
#       until 9: a copies 9..11.
#  t=9  b on B; B prefills r1 (r2 waits for a): 30 ms -> 39.
#  t=11 a on B; B is busy.
#  t=32 r0's first token. A decodes [2]: 0.5·1·2 + 10 = 11 ms -> 43, then 43 -> 54.
#  t=39 r1's first token. B prefills r2 (1 free slot): 20 + 20 = 40 ms -> 79.
#  t=54 A's second decode step: r0's third token; r0 done.
#  t=79 r2's first token. B decodes [4, 2]: 0.5·2·4 + 10 = 14 ms -> 93.
#  t=93 r1's second token and r2's second token.
#
#        instance  TTFT            TPT = (last - first) / (tokens - 1)
#   r0   A         32 - 0  = 32    (54 - 32) / 2 = 11
#   r1   B         39 - 5  = 34    (93 - 39) / 1 = 54   (r2's 40 ms prefill stalled it)
#   r2   B         79 - 6  = 73    (93 - 79) / 1 = 14
#
# SLO 15 ms: r0 and r2 meet it, r1 does not: attainment 2/3, mean TPT 79/3, p99 TPT
# 14 + 0.98·(54 - 14) = 53.2 (numpy's linear interpolation between the two largest).
TWO_INSTANCE_REQUESTS = [
    _request(0.0, 10, 3, "a", 2),
    _request(5.0, 10, 2, "b", 4),
    _request(6.0, 20, 2, "a", 2),
]
TWO_INSTANCE_CONFIG = InstanceConfig(
    max_batch=2, max_prefill_tokens=100, adapter_slots=2, load_ms_per_rank=1.0
)


def test_two_instances_by_hand():
    profile = _profile(alpha=0.5)
    policy = router.app.build_policy("most-idle")
    result = simulate(
        TWO_INSTANCE_REQUESTS, policy, instances=2, profile=profile, config=TWO_INSTANCE_CONFIG
    )
    assert result.instance.tolist() == [0, 1, 1]
    assert result.ttft_ms.tolist() == [32.0, 34.0, 73.0]
    assert result.tpt_ms.tolist() == [11.0, 54.0, 14.0]
    assert simulator.slo_ms(profile) == 15.0
    row = simulator.summarize("most-idle", 1.0, result, simulator.slo_ms(profile))
    assert row["slo_attainment"] == pytest.approx(2 / 3)
    assert row["mean_tpt_ms"] == pytest.approx(79 / 3)
    assert row["p99_tpt_ms"] == pytest.approx(53.2)


# -- rank-aware's SLO check, placements only ---------------------------------------------
#
# Profile: α = 0.25, so DecPerf(S) = 0.25·|S|·max rank + 10 and SLO 15 allows |S|·max
# rank <= 20. Adapters load in 0 ms; 4 slots; avg_resp_len 10; outputs of 100 tokens, so
# nothing finishes while the five requests arrive. A prefill takes 30 ms, so whatever
# an instance took first is still prefilling ("running") at t <= 4 and later arrivals
# queue. Rank-aware's total = (Δprefill/10 + Δdecode) x requests, inf past the SLO.
#  q0 t=0 rank 8: both idle, total 0 -> A (first).
#  q1 t=1 rank 2: B idle, total 0 -> B.
#  q2 t=2 rank 2: A [8]: Δp 30/10 + (DecPerf[8,2] 14 - 12) = 5, x1 = 5;
#                 B [2]: 3 + (DecPerf[2,2] 11 - 10.5) = 3.5, x1 = 3.5 -> B.
#  q3 t=3 rank 8: A [8]: 3 + (DecPerf[8,8] 14 - 12) = 5, x1;
#                 B [2] + queued 2: DecPerf[2,2,8] = 16 > 15, inf -> A.
#  q4 t=4 rank 2: A [8] + queued 8: DecPerf[8,8,2] = 16 > 15, inf;
#                 B [2] + queued 2: Δp (40 - 30)/10 + (DecPerf[2,2,2] 11.5 - 11) = 1.5,
#                 x2 = 3 -> B.
# most-idle mixes them: q0 A; q1 B (0 < 1); q2 A (tie 1:1, 3 free each, first); q3 B
# (1 < 2); q4 A (tie 2:2, 3 free each, first).
RANK_REQUESTS = [
    _request(float(t), 10, 100, f"adapter-r{rank}-{t}", rank)
    for t, rank in enumerate((8, 2, 2, 8, 2))
]


@pytest.mark.parametrize(
    "name, placements", [("rank-aware", [0, 1, 1, 0, 1]), ("most-idle", [0, 1, 0, 1, 0])]
)
def test_rank_aware_keeps_ranks_apart(name, placements):
    profile = _profile(alpha=0.25)
    policy = router.app.build_policy(name, profile=profile, avg_resp_len=10.0)
    config = InstanceConfig(max_batch=4, load_ms_per_rank=0.0)
    result = simulate(RANK_REQUESTS, policy, instances=2, profile=profile, config=config)
    assert result.instance.tolist() == placements


# -- the router's policy objects ---------------------------------------------------------


@pytest.mark.parametrize(
    "name, cls",
    [
        ("rank-aware", RankAware),
        ("shortest-pending", ShortestPending),
        ("most-idle", MostIdle),
        ("first-fit", FirstFit),
        ("random", RandomChoice),
    ],
)
def test_policies_are_the_routers(name, cls):
    assert simulator.build_policy is router.app.build_policy
    assert POLICIES[name] is cls
    config = InstanceConfig()
    requests = [_request(0.0, 10, 4, "a", 8), _request(1.0, 30, 8, "b", 64)]
    policy = simulator.make_policy(name, simulator.paper_profile(), requests, config, seed=3)
    assert type(policy) is cls
    if isinstance(policy, RankAware):
        assert policy.slo_ms == simulator.slo_ms(simulator.paper_profile())
        assert policy.avg_resp_len == 6.0
    if isinstance(policy, ShortestPending):
        assert policy.adapter_load_ms == pytest.approx(config.load_ms(36))
    if isinstance(policy, RandomChoice):
        assert policy.seed == 3


def test_decode_fast_path_is_rank_feature():
    """PerfModel.predict's decode path (no token counts) equals Eq. 2 via rank_feature."""
    rng = random.Random(0)
    for kind in ("bgmv", "mbgmv"):
        model = PerfModel(kind, alpha=0.0036, beta=32.07, gamma=0.25)
        for size in (1, 2, 3, 7, 16, 133):
            ranks = [rng.choice((0, 8, 16, 32, 64)) for _ in range(size)]
            expected = model.alpha * rank_feature(kind, ranks) + model.gamma * size + model.beta
            assert model.predict(ranks) == expected
            assert model.predict(ranks) == model.predict(ranks, [1] * size)


# -- metrics, rows, determinism ----------------------------------------------------------


def test_slo_attainment_counts_requests_with_a_tpt():
    result = RunResult(
        instance=np.zeros(5, np.int32),
        ttft_ms=np.ones(5),
        tpt_ms=np.array([10.0, 15.0, 15.0001, math.nan, 20.0]),  # NaN: one output token
    )
    row = simulator.summarize("random", 7.0, result, slo=15.0)
    assert row["slo_attainment"] == 0.5  # 10 and 15 of the four with a TPT
    assert row["mean_tpt_ms"] == pytest.approx((10 + 15 + 15.0001 + 20) / 4)


def test_json_rows_and_plots(tmp_path):
    rows_path = tmp_path / "rows.json"
    simulator.main([
        "--instances", "3", "--duration-s", "20", "--rates", "2,3",
        "--policies", "rank-aware,random", "--processes", "1",
        "--json", str(rows_path), "--out-dir", str(tmp_path), "--cdf-rate", "3",
    ])  # fmt: skip
    rows = json.loads(rows_path.read_text())
    assert [(row["policy"], row["rate"]) for row in rows] == [
        ("rank-aware", 2.0), ("random", 2.0), ("rank-aware", 3.0), ("random", 3.0),
    ]  # fmt: skip
    for row in rows:
        assert set(row) == {"policy", "rate", "slo_attainment", "mean_tpt_ms", "p99_tpt_ms"}
        assert 0.0 <= row["slo_attainment"] <= 1.0
        assert row["mean_tpt_ms"] <= row["p99_tpt_ms"]
    names = {path.name.split("-", 3)[-1] for path in tmp_path.iterdir()}  # past the date
    assert {"simulator.md", "simulator-slo-attainment.png", "simulator-tpt-cdf-3rps.png"} <= names


def test_deterministic_under_a_seed():
    def run(seed: int) -> tuple[list[Request], RunResult]:
        spec = cluster.WorkloadSpec(rate=4.0, duration_s=30.0, seed=seed)
        requests = cluster.make_workload(spec)
        policy = simulator.make_policy(
            "random", simulator.paper_profile(), requests, InstanceConfig(), seed=seed
        )
        profile = simulator.paper_profile()
        return requests, simulate(requests, policy, instances=4, profile=profile)

    (requests, first), (again_requests, again) = run(1), run(1)
    assert requests == again_requests
    assert len(requests) == 4 * 30 and requests[-1].arrival_ms < 30_000.0
    for field in ("instance", "ttft_ms", "tpt_ms"):
        np.testing.assert_array_equal(getattr(first, field), getattr(again, field))
    other_requests, other = run(2)
    assert [r.adapter for r in other_requests] != [r.adapter for r in requests]
    assert other.instance.tolist() != first.instance.tolist()
