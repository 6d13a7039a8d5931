"""dLoRA's dynamic batching policy (jlora/engine/merging.py): Algorithms 1-3 on hand-made
queues and recorded step times."""

from __future__ import annotations

import itertools
import random

import pytest

from jlora.engine.api import Request, SamplingParams
from jlora.engine.merging import DynamicBatcher, MergeSettings, StepTimes, _Iteration
from jlora.engine.mock import mock_completion, mock_engine


def queue(*adapters: str | None) -> list[tuple[str, str | None]]:
    """Runnable requests in FCFS order, named r0, r1, ... with their adapters."""
    return [(f"r{i}", adapter) for i, adapter in enumerate(adapters)]


class TestAlgorithm1:
    def test_a_dominant_adapter_is_merged(self):
        batcher = DynamicBatcher("auto", max_bs=4)
        # B_fcfs = r0..r3; R_merge = a's 3 requests: 3/4 = 0.75 > alpha 0.6.
        batch = batcher.plan(queue("a", "b", "a", "a", "a"))
        assert (batch.merged, batch.reason) == ("a", "merged")
        assert batch.items == ("r0", "r2", "r3", "r4")

    def test_a_uniform_mix_stays_unmerged(self):
        batcher = DynamicBatcher("auto", max_bs=4)
        # R_merge = a (first of the ties) with 2 of 8 runnable, 2 in the batch: 2/4 = 0.5.
        batch = batcher.plan(queue("a", "b", "c", "d", "a", "b", "c", "d"))
        assert (batch.merged, batch.reason) == (None, "fcfs")
        assert batch.items == ("r0", "r1", "r2", "r3")

    def test_the_base_model_never_merges(self):
        batcher = DynamicBatcher("auto", max_bs=4)
        batch = batcher.plan(queue(None, None, None, "a"))
        assert batch.merged is None

    def test_merged_state_leaves_below_beta(self):
        batcher = DynamicBatcher("auto", max_bs=4)
        assert batcher.plan(queue("a", "a", "a", "a")).merged == "a"
        # Now a has 1 of 4: 0.25 < beta 0.4: unmerge, run the FCFS batch.
        batch = batcher.plan(queue("b", "c", "a", "d"))
        assert (batch.merged, batch.items) == (None, ("r0", "r1", "r2", "r3"))

    def test_merged_state_stays_between_the_marks(self):
        batcher = DynamicBatcher("auto", max_bs=4)
        assert batcher.plan(queue("a", "a", "a", "a")).merged == "a"
        # a has 2 of 4: 0.5 is below alpha (0.6) but not below beta (0.4): stay merged.
        batch = batcher.plan(queue("b", "a", "c", "a"))
        assert (batch.merged, batch.items) == ("a", ("r1", "r3"))

    def test_always_merges_whatever_the_mix(self):
        batcher = DynamicBatcher("always", max_bs=4)
        batch = batcher.plan(queue("a", "b", "c", "d"))
        assert batch.merged == "a" and batch.items == ("r0",)
        # a is done: switch straight to another adapter, with no unmerged iteration.
        assert batcher.plan(queue("b", "c", "d")).merged == "b"


class TestCredits:
    def test_credit_moves_from_the_served_to_the_skipped(self):
        settings = MergeSettings(initial_credit=0.0)
        batcher = DynamicBatcher("auto", max_bs=2, settings=settings)
        # FCFS batch r0 (b), r1 (a); merged batch a: r1, r2. r0 would be skipped (b +1),
        # r2 run ahead of its turn (a -1): a's cost is 1 and its credit 0 < 1: no merge.
        batch = batcher.plan(queue("b", "a", "a"))
        assert batch.merged is None
        assert dict(batcher.credits) == {"a": 0.0, "b": 0.0}
        # With credit, it may: the transfer is as stated.
        batcher.credits["a"] = 1.0
        batch = batcher.plan(queue("b", "a", "a"))
        assert (batch.merged, batch.items) == ("a", ("r1", "r2"))
        assert dict(batcher.credits) == {"a": 0.0, "b": 1.0}

    def test_every_type_starts_with_max_bs_credit(self):
        batcher = DynamicBatcher("auto", max_bs=4)
        assert batcher.credits["a"] == batcher.credits[None] == 4.0

    def test_a_starving_adapter_is_served_first(self):
        settings = MergeSettings(t_starve=2.0, initial_credit=0.0)
        batcher = DynamicBatcher("always", max_bs=2, settings=settings)
        batcher.credits["b"] = 2.5
        batch = batcher.plan(queue("a", "a", "b"))
        # b starves: its request runs first, the free row goes to the FCFS batch's head;
        # r2 (b) displaced the FCFS batch r0, r1 (a): a +2, b -2 (r0 fills the free row).
        assert (batch.reason, batch.merged, batch.items) == ("starving", None, ("r2", "r0"))
        assert batcher.credits["b"] == 0.5 and batcher.credits["a"] == 2.0

    @pytest.mark.parametrize("mode", ["always", "auto"])
    def test_starvation_bound_under_a_flood(self, mode):
        """One adapter's request amid a flood of another's: without credits it would
        never run under merged-only batching; with them, its longest run of iterations
        left out stays within `MergeSettings.starvation_bound`."""
        settings = MergeSettings(t_starve=12.0, t_normal=0.0)
        max_bs = 4
        batcher = DynamicBatcher(mode, max_bs=max_bs, settings=settings)
        bound = settings.starvation_bound(max_bs)
        assert bound == 12 + 4 + 1
        ids = itertools.count()
        flood = [(f"a{next(ids)}", "a") for _ in range(3)]
        victim = ("victim", "b")
        gap = longest = served = 0
        for _ in range(400):
            # The victim stays in B_fcfs (it arrived early); fresh a requests keep arriving.
            runnable = [flood[0], victim, *flood[1:]]
            batch = batcher.plan(runnable)
            if "victim" in batch.items:
                served += 1
                gap = 0
            else:
                gap += 1
                longest = max(longest, gap)
            flood = [item for item in flood if item[0] not in batch.items[:1]]
            flood += [(f"a{next(ids)}", "a") for _ in range(4 - len(flood))]
        assert served > 0
        assert longest <= bound
        if mode == "always":
            assert longest >= 4  # the flood's merged batches did leave it out


class TestAlgorithm2:
    def batcher(self) -> DynamicBatcher:
        batcher = DynamicBatcher("auto", max_bs=8)
        # Recorded decode steps: unmerged 10 ms + 1 ms/row, merged 5 ms + 0.5 ms/row.
        for rows in (2, 4, 8):
            batcher.times.observe(False, rows, 0.010 + 0.001 * rows)
            batcher.times.observe(True, rows, 0.005 + 0.0005 * rows)
        return batcher

    def test_throughputs_are_the_papers_lines_4_and_5(self):
        batcher = self.batcher()
        batcher.switch_seconds = 0.010
        period = [_Iteration(merged_size=6, fcfs_size=8, seconds=0.018)] * 3
        merged, unmerged = batcher.throughputs(period, merged_ran=False, switch=0.0)
        # T_merge = 3·6 / (3·(5 + 0.5·6) ms + t_M 10 ms) = 18 / 0.034 s;
        # T_unmerge = 3·8 / (3·18 ms) = 24 / 0.054 s.
        assert merged == pytest.approx(18 / 0.034)
        assert unmerged == pytest.approx(24 / 0.054)

    def test_alpha_falls_when_merged_would_have_been_faster(self):
        batcher = self.batcher()
        batcher.alpha = 0.9  # an unmerged period whose ratio (6/8) stays below alpha
        alpha = batcher.alpha
        for _ in range(batcher.settings.period + 1):
            batcher.plan(queue("a", "a", "a", "a", "a", "a", "b", "c"))  # 6/8 < 0.9
            batcher.observe(False, 8, 0.018)
        assert batcher.merged is None
        assert batcher.alpha == pytest.approx(alpha - batcher.settings.gamma_dec)

    def test_alpha_rises_when_unmerged_was_faster(self):
        batcher = DynamicBatcher("auto", max_bs=8)
        for rows in (2, 4, 8):  # merged steps cost as much as unmerged ones here
            batcher.times.observe(False, rows, 0.010 + 0.001 * rows)
            batcher.times.observe(True, rows, 0.010 + 0.001 * rows)
        batcher.switch_seconds = 0.05
        alpha = batcher.alpha
        for _ in range(batcher.settings.period + 1):
            batcher.plan(queue("a", "a", "b", "c", "d", "e", "f", "g"))  # 2/8
            batcher.observe(False, 8, 0.018)
        assert batcher.alpha == pytest.approx(alpha * batcher.settings.gamma_mul)

    def test_beta_falls_while_merging_pays_and_rises_when_it_does_not(self):
        for merged_step, direction in ((0.004, -1), (0.030, +1)):
            batcher = DynamicBatcher("auto", max_bs=8)
            for rows in (2, 4, 8):
                batcher.times.observe(False, rows, 0.010 + 0.001 * rows)
            beta = batcher.beta
            for _ in range(batcher.settings.period + 1):
                assert batcher.plan(queue(*["a"] * 8)).merged == "a"
                batcher.observe(True, 8, merged_step)
            moved = batcher.beta - beta
            if direction < 0:
                assert moved == pytest.approx(-batcher.settings.gamma_dec)
            else:
                assert batcher.beta == pytest.approx(
                    min(beta * batcher.settings.gamma_mul, batcher.alpha - 0.1)
                )

    def test_the_marks_never_cross(self):
        batcher = self.batcher()
        for _ in range(20 * batcher.settings.period):
            batcher.plan(queue("a", "a", "a", "a", "a", "a", "b", "c"))
            batcher.observe(batcher.merged is not None, 8, 0.001)
            assert batcher.beta <= batcher.alpha - batcher.settings.hysteresis + 1e-12
            assert batcher.settings.min_alpha <= batcher.alpha <= batcher.settings.max_alpha


class TestStepTimes:
    def test_fit_and_fallback(self):
        times = StepTimes()
        assert times.predict(True, 4) is None
        times.observe(False, 2, 0.012)
        times.observe(False, 6, 0.016)
        assert times.predict(False, 4) == pytest.approx(0.014)
        assert times.predict(True, 4) == pytest.approx(0.014)  # borrowed: no merged sample
        times.observe(True, 4, 0.005)
        assert times.predict(True, 8) == pytest.approx(0.005)  # one batch size: its mean


def test_settings_are_validated():
    with pytest.raises(ValueError, match="gamma_mul"):
        MergeSettings(gamma_mul=0.5)
    with pytest.raises(ValueError, match="t_normal"):
        MergeSettings(t_normal=10.0, t_starve=1.0)
    with pytest.raises(ValueError, match="mode"):
        DynamicBatcher("never", max_bs=4)


# -- the orchestrator with merging on, over the mock engine -------------------------------

VOCAB = 1000


def drive(engine, *, feed=None, max_steps: int = 5000) -> dict[str, list[int]]:
    """Step until done (calling `feed(engine, step)` before each step); tokens per id."""
    tokens: dict[str, list[int]] = {}
    for step in range(max_steps):
        if feed is not None:
            feed(engine, step)
        if not engine.has_unfinished:
            return tokens
        for event in engine.step():
            assert event.error is None, event.error
            tokens.setdefault(event.request_id, []).append(event.token_id)
    raise AssertionError("the engine did not finish")


def add(engine, request_id: str, adapter: str | None, max_tokens: int, prompt=(3, 4)) -> None:
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    engine.add_request(Request(request_id, list(prompt), sampling, adapter))


def loaded(engine, *names: str):
    """`engine` once `names` are on the device (a request for an adapter still loading
    is not runnable, which is not what these tests are about)."""
    for name in names:
        engine.load_adapter(name)
    while not all(engine.adapters.slots.is_ready(name) for name in names):
        engine.adapters.slots.wait(timeout=1.0)
        engine.adapters.poll()
    return engine


class TestOrchestrator:
    @pytest.mark.parametrize("merge", ["never", "auto", "always"])
    def test_tokens_do_not_depend_on_merging(self, merge):
        engine = mock_engine(
            adapters={"a": 8, "b": 16, "c": 8}, max_loras=3, max_slots=4, merge=merge
        )
        rng = random.Random(7)
        expected = {}
        for i in range(24):
            adapter = rng.choice(["a", "a", "a", "b", "c", None])
            prompt, count = [rng.randrange(VOCAB) for _ in range(3)], rng.randint(1, 12)
            add(engine, f"r{i}", adapter, count, prompt)
            expected[f"r{i}"] = mock_completion(prompt, adapter, count, VOCAB)
        assert drive(engine) == expected
        assert engine.memory.held_pages() == 0
        assert engine.adapters.slots.stats()  # slots released: none in use
        assert all(engine.adapters.slots.in_use(name) == 0 for name in "abc")
        if merge != "never":
            stats = engine.stats().merging
            assert stats.merged_iterations > 0 and stats.switches > 0

    @pytest.mark.parametrize(("mix", "concurrency", "merged_at_least", "merged_at_most"), [
        ("a" * 9 + "b", 32, 0.6, 1.0),  # one adapter draws 90%
        ("abcd", 8, 0.0, 0.2),  # uniform over four, as many requests as rows
    ])  # fmt: skip
    def test_auto_merges_a_skewed_mix_and_not_a_uniform_one(
        self, mix, concurrency, merged_at_least, merged_at_most
    ):
        """Closed loop: `concurrency` requests outstanding, each replaced when it ends.
        (With a queue several times the rows deep, auto merges even a uniform mix, one
        adapter after another: each merged batch is then as full as the FCFS one and
        cheaper, which is what Algorithm 1's ratio asks; credits make it round-robin.)"""
        # LoRA rows cost as much again as the base step: merged steps are half price.
        engine = mock_engine(
            adapters=dict.fromkeys("abcd", 8),
            max_loras=4,
            max_slots=8,
            merge="auto",
            step_latency=0.001,
            lora_latency=0.001,
        )
        loaded(engine, *"abcd")
        rng = random.Random(0)
        ids = itertools.count()

        def feed(engine, step):
            while engine.num_waiting + engine.num_running < concurrency and step < 300:
                add(engine, f"r{next(ids)}", rng.choice(mix), rng.randint(8, 24))

        drive(engine, feed=feed)
        stats = engine.stats().merging
        share = stats.merged_iterations / (stats.merged_iterations + stats.unmerged_iterations)
        assert merged_at_least <= share <= merged_at_most

    def test_a_flood_does_not_starve_another_adapter(self):
        """merged-only batching with one request of b amid an endless flood of a: b's
        longest run of steps without a token stays within the stated bound."""
        engine = mock_engine(adapters={"a": 8, "b": 8}, max_slots=2, merge="always")
        loaded(engine, "a", "b")
        bound = engine.batcher.settings.starvation_bound(engine.max_slots)
        ids = itertools.count()
        add(engine, "flood-first", "a", 4)
        add(engine, "victim", "b", 6)

        def feed(engine, step):
            if step < 400:
                while engine.num_waiting < 4:
                    add(engine, f"a{next(ids)}", "a", 4)

        gaps, last = [], 0
        original_step = engine.step

        def step():
            nonlocal last
            events = original_step()
            engine_steps = engine.device.steps
            if any(event.request_id == "victim" for event in events):
                gaps.append(engine_steps - last)
                last = engine_steps
            return events

        engine.step = step
        tokens = drive(engine, feed=feed)
        assert tokens["victim"] == mock_completion([3, 4], "b", 6, VOCAB)
        assert max(gaps) <= bound
        assert engine.stats().merging.switches > 2

    def test_paused_requests_can_be_aborted_and_exported(self):
        engine = mock_engine(adapters={"a": 8, "b": 8}, max_slots=2, merge="always")
        loaded(engine, "a", "b")
        for name in ("a1", "b1", "a2", "b2"):
            add(engine, name, name[0], 30)
        paused: set[str] = set()
        while not paused:  # merged-only batching pauses one adapter's requests for another's
            engine.step()
            paused = {info.request_id for info in engine.stats().running if info.slot == -1}
        some = sorted(paused)[0]
        state = engine.export(some)
        assert state.generated and state.adapter == some[0]
        for name in ("a1", "b1", "a2", "b2"):
            engine.abort(name)
        assert engine.memory.held_pages() == 0 and not engine.has_unfinished
        assert all(engine.adapters.slots.in_use(name) == 0 for name in "ab")
        # The exported request resumes (here, in the same engine) with the same tokens.
        engine.resume(state)
        rest = drive(engine)[some]
        assert [*state.generated, *rest] == mock_completion([3, 4], some[0], 30, VOCAB)


def test_merging_refuses_cpu_assisted_modes():
    from configs import ConfigError, EngineConfig

    with pytest.raises(ConfigError, match="merge='auto' works with lora_mode 'ondemand'"):
        EngineConfig(max_loras=2, merge="auto", lora_mode="cpu-assist")
