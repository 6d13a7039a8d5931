"""`prefill_many`: several prompts packed into one compiled prefill (jlora/device/packing.py).

A packed call must give each job what `prefill(job)` gives alone (device_api.py): the same
first token, logits and keys and values to the model tolerance, and so the same greedy
continuation. The prompts below (5, 23, 16 and 40 tokens: one call of the 128-token
bucket, whose attention runs in windows, prompts being at most 64 tokens) mix two
adapters of different ranks and the base model, one samples at a temperature, and they
run on every LoRA backend (Pallas kernels interpreted on a CPU), on cpu-tiny. Jobs that
are not plain (a cached prefix, CPU assistance) or too long run one by one; a fault of
one of them is reported in its result, and the others are served.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import numpy as np
import pytest

from configs import EngineConfig, bucket
from jlora.adapters.peft import make_demo_adapters
from jlora.contract.errors import RequestError
from jlora.device.llama_engine import LlamaEngine
from jlora.device.packing import layout, packs
from jlora.device.sampling import host_sampling
from jlora.engine.device_api import DecodeRow, DeviceEngine, PrefillJob, SamplingRow
from jlora.engine.mock import MockEngine
from jlora.model.kv_cache import KVCache
from jlora.model.lora.base import Segments
from tests.tolerances import assert_close

GREEDY = SamplingRow(temperature=0.0, top_k=0, top_p=1.0, seed=0, step=0)
WARM = SamplingRow(temperature=0.8, top_k=20, top_p=0.9, seed=7, step=0)
LENGTHS = (5, 23, 16, 40)
ADAPTERS = {"a": 0, "b": 1}  # name -> device slot
ROWS = ("a", None, "b", "a")  # each prompt's adapter
STEPS = 5  # greedy tokens compared after a prefill (its own first token included)


@pytest.fixture(scope="module", params=["reference", "bgmv", "mbgmv"])
def engine(request, tiny, tmp_path_factory):
    """A LlamaEngine with adapters "a" (rank 8) and "b" (rank 16) installed."""
    engine = LlamaEngine(
        model_config=tiny.config,
        params=tiny.params,
        tokenizer=None,
        engine_config=EngineConfig(
            max_slots=4,
            max_seq_len=256,  # packed calls of up to 256 tokens, prompts of up to 64
            min_bucket=16,
            kv_cache_tokens=96 * 16,
            max_loras=2,
            max_lora_rank=16,
            host_store_mib=64,
            lora_backend=request.param,
        ),
    )
    paths = make_demo_adapters(
        tiny.config, tmp_path_factory.mktemp("demo"), n=2, ranks=[8, 16], seed=11
    )
    for (name, slot), path in zip(ADAPTERS.items(), paths, strict=True):
        engine.stage_adapter(name, str(path))
        engine.install_adapter(name, slot, engine.load_adapter(name, slot))
    yield engine
    engine.close()


def _prompt(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 512, length).tolist()


class _Blocks:
    """Block tables from consecutive fresh blocks (a test's tables never share blocks
    unless it says so)."""

    def __init__(self, engine: DeviceEngine) -> None:
        self.config, self.next = engine.config, 0

    def table(self, tokens: int, shared: Sequence[int] = ()) -> np.ndarray:
        """A table for `tokens` tokens and STEPS more: `shared`, then fresh blocks."""
        cfg = self.config
        count = math.ceil((tokens + STEPS) / cfg.block_size) - len(shared)
        table = np.full(cfg.blocks_per_seq, cfg.num_blocks, np.int32)
        table[: len(shared) + count] = [*shared, *range(self.next, self.next + count)]
        self.next += count
        return table

    def jobs(self, seed: int = 0) -> list[PrefillJob]:
        """The four mixed prompts; the third samples at a temperature."""
        return [
            PrefillJob(
                _prompt(length, seed + i),
                self.table(length),
                WARM if i == 2 else GREEDY,
                adapter_slot=-1 if name is None else ADAPTERS[name],
            )
            for i, (length, name) in enumerate(zip(LENGTHS, ROWS, strict=True))
        ]

    def moved(self, job: PrefillJob) -> PrefillJob:
        """`job` on fresh blocks."""
        return dataclasses.replace(job, block_table=self.table(len(job.tokens)))


def _kv(engine, job: PrefillJob) -> tuple[np.ndarray, np.ndarray]:
    """The keys and values of a job's prompt positions: [layers, n, kv_heads, head_dim]."""
    positions = np.arange(len(job.tokens))
    size = engine.config.block_size
    blocks, offsets = job.block_table[positions // size], positions % size
    return tuple(
        np.asarray(pages)[:, blocks, offsets] for pages in (engine.cache.k, engine.cache.v)
    )


class _Spy:
    """Wraps `engine.prefill`, recording the jobs that reach it; `fail(job)` says which
    to fail as a CPU worker that cannot recover would."""

    def __init__(self, monkeypatch, engine, fail=lambda job: False) -> None:
        self.jobs: list[PrefillJob] = []
        real = engine.prefill

        def prefill(job):
            self.jobs.append(job)
            if fail(job):
                raise RequestError("the CPU workers are gone", reason="CPU_ASSIST_FAILED")
            return real(job)

        monkeypatch.setattr(engine, "prefill", prefill)


def continue_greedy(engine: DeviceEngine, jobs: list[PrefillJob], packed: bool) -> list[list[int]]:
    """Each job's first token (from one `prefill_many`, or one `prefill` each) and the
    STEPS - 1 greedy tokens after it, the jobs decoding side by side in rows 0, 1, ..."""
    if packed:
        first = [result.token for result in engine.prefill_many(jobs)]
    else:
        first = [engine.prefill(job).token for job in jobs]
    for row, (job, token) in enumerate(zip(jobs, first, strict=True)):
        sampling = dataclasses.replace(GREEDY, step=1)
        engine.insert(
            row, DecodeRow(token, len(job.tokens), job.block_table, sampling, job.adapter_slot)
        )
    tokens = [[token] for token in first]
    for _ in range(STEPS - 1):
        step = engine.generate()
        for row, out in enumerate(tokens):
            out.append(int(step[row]))
    for row in range(len(jobs)):
        engine.free(row)
    return tokens


def test_a_packed_call_gives_each_job_its_own_prefill(engine, monkeypatch):
    """One compiled call (no `prefill`), the same first tokens and keys and values as one
    prefill each on other blocks."""
    assert (engine.packed_prefill_tokens, engine.packed_prefill_prompts) == (256, 4)
    assert engine.packed_prefill_prompt_tokens == 64
    blocks = _Blocks(engine)
    jobs = blocks.jobs()
    spy = _Spy(monkeypatch, engine)
    packed = engine.prefill_many(jobs)
    assert spy.jobs == []
    monkeypatch.undo()
    alone = [blocks.moved(job) for job in jobs]
    assert [r.token for r in packed] == [engine.prefill(job).token for job in alone]
    assert all(r.error is None for r in packed)
    for job, other in zip(jobs, alone, strict=True):
        for got, want in zip(_kv(engine, job), _kv(engine, other), strict=True):
            assert_close(got, want, np.float32, np.float32, scope="model")


@pytest.mark.parametrize(
    "longest, host", [(None, False), (40, False), (40, True)], ids=["all-keys", "windowed", "host"]
)
def test_packed_logits_equal_each_prompts_alone(engine, longest, host):
    """The model's packed prefill, padded to six prompt rows (two empty) and 96 tokens,
    its attention over every key, (longest=40) in windows of 20 queries and the 40 keys
    before them, or by the host kernel (each prompt by itself), and its LoRA segments
    over every row or over windows of 40 (adapter a's two prompts, 5 + 40 tokens, cut in
    two): each prompt's last logits are its single prefill's; an adapted prompt's differ
    from the base model's (its segment reaches it)."""
    model, weights = engine.model, engine.lora.weights
    jobs = _Blocks(engine).jobs(seed=10)
    sentinel = engine.config.num_blocks
    call = layout(
        jobs, 96, 6, num_blocks=sentinel, window=longest, sampling=engine.steps.sampling_rows(6)
    )
    assert len(set(call.segments.start.tolist())) == (5 if longest else 4)
    tables = np.full((6, 16), sentinel, np.int32)
    tables[:4, :3] = np.arange(12).reshape(4, 3)  # each prompt's own three blocks
    packed, _ = jax.jit(model.prefill_packed, static_argnames=("longest", "host_attention"))(
        engine.params,
        _cache(engine),
        call.tokens,
        call.starts,
        tables,
        weights,
        call.segments,
        longest=longest,
        host_attention=host,
    )
    packed = np.asarray(packed)
    assert packed.shape == (6, engine.vocab_size)
    single = jax.jit(model.prefill)
    for j, job in enumerate(jobs):
        tokens = np.zeros(64, np.int32)
        tokens[: len(job.tokens)] = job.tokens
        args = (engine.params, _cache(engine), tokens, np.int32(len(job.tokens)), np.arange(16))
        logits, _ = single(*args, weights, Segments.single(job.adapter_slot, 64))
        assert_close(packed[call.rows[j]], logits, np.float32, np.float32, scope="model")
        if job.adapter_slot >= 0:
            base, _ = single(*args, weights, Segments.single(-1, 64))
            assert not np.allclose(logits, base, atol=1e-2)


def _cache(engine) -> KVCache:
    """The engine's cache, for the model alone: its adapters live in its pages (at the
    top, `slot_pages`), which the tests' blocks (from 0) stay below; the calls do not
    donate it, so it is left as it was."""
    if engine.lora.backend.pooled:
        assert min(engine.slot_pages(engine.config.max_loras - 1)) >= 16
    return engine.cache


def test_a_prompts_continuation_does_not_depend_on_its_pack(engine):
    """Batch invariance: each prompt's greedy tokens after a packed prefill are those after
    a prefill of its own."""
    blocks = _Blocks(engine)
    jobs = [dataclasses.replace(job, sampling=GREEDY) for job in blocks.jobs(seed=20)]
    packed = continue_greedy(engine, jobs, packed=True)
    assert packed == continue_greedy(engine, [blocks.moved(job) for job in jobs], packed=False)


def test_jobs_that_are_not_plain_run_one_by_one_and_fail_alone(engine, monkeypatch):
    """A cached prefix (written by an earlier job of the same list), a prompt longer than
    packed_prefill_prompt_tokens, a CPU-assisted job and a plain job left alone in its
    call go through `prefill`, in order;
    the assisted one fails there, and only it."""
    if engine.config.lora_backend != "reference":
        pytest.skip("the routing does not depend on the backend")
    blocks = _Blocks(engine)
    _, base, warm, last = blocks.jobs(seed=30)
    earlier = PrefillJob(_prompt(16, seed=30), blocks.table(16), GREEDY, ADAPTERS["a"])
    extended = earlier.tokens + _prompt(20, seed=31)
    cached = dataclasses.replace(
        earlier,
        tokens=extended,
        block_table=blocks.table(len(extended), shared=earlier.block_table[:1].tolist()),
        cached=16,
    )
    long = PrefillJob(_prompt(65, seed=32), blocks.table(65), GREEDY, ADAPTERS["b"])
    assisted = dataclasses.replace(warm, assist="b")
    jobs = [earlier, cached, base, long, last, assisted]
    spy = _Spy(monkeypatch, engine, fail=lambda job: job.assist is not None)
    results = engine.prefill_many(jobs)
    # The plain ones: base and last (23 + 40 tokens) fill a call of 64; earlier's 16 more
    # would pad it to 128, so earlier runs alone, before the cached job that reads it.
    routed = [id(earlier), id(cached), id(long), id(assisted)]
    assert [id(job) for job in spy.jobs] == routed
    assert results[-1].token == -1 and results[-1].error.reason == "CPU_ASSIST_FAILED"
    assert all(result.error is None for result in results[:-1])
    monkeypatch.undo()
    full = dataclasses.replace(cached, block_table=blocks.table(len(extended)), cached=0)
    assert results[1].token == engine.prefill(full).token
    for index in (0, 2, 3, 4):
        assert results[index].token == engine.prefill(blocks.moved(jobs[index])).token


def test_merged_packed_calls_equal_one_by_one(engine):
    """While merged the packed call runs the merged steps (no LoRA weights)."""
    if engine.config.lora_backend != "reference":
        pytest.skip("the merged steps have no LoRA backend")
    blocks = _Blocks(engine)
    jobs = [dataclasses.replace(job, adapter_slot=ADAPTERS["a"]) for job in blocks.jobs(40)]
    engine.merge("a")
    try:
        packed = continue_greedy(engine, jobs, packed=True)
        alone = continue_greedy(engine, [blocks.moved(job) for job in jobs], packed=False)
    finally:
        engine.unmerge()
    assert packed == alone


def test_a_packed_call_on_a_mesh_equals_one_prefill_each_on_one_device():
    """tp2, adapters fully sharded (x·A's all-gather and all-reduce run over the packed
    segments), the reference backend (tests/sharded_checks.py, fake devices)."""
    from tests.test_sharding import run_checks

    case = "packed:cpu-tiny:tp2:fully-sharded:reference"
    result = run_checks(case, processes=1)[case]
    assert result["sharded"] == result["single"]


# -- the host side, and the interface's default ----------------------------------------


def _computed(calls: list[list[int]], lengths: list[int], sizes: tuple[int, ...]) -> int:
    return sum(bucket(sizes, sum(lengths[i] for i in call)) for call in calls)


def _in_order(lengths: list[int], tokens: int, prompts: int) -> list[list[int]]:
    """The plain way: each prompt joins the current call while it has room."""
    calls: list[list[int]] = []
    held = 0
    for index, length in enumerate(lengths):
        if not calls or len(calls[-1]) == prompts or held + length > tokens:
            calls.append([])
            held = 0
        calls[-1].append(index)
        held += length
    return calls


def test_packs_fill_their_sizes():
    """bench.prefill's workload: 64 prompts of 16-64 tokens, 16 to a call of at most 512,
    six draws. Every prompt in one call, the limits held, never more computed than
    filling the calls in order, and 4% less over the draws (seed 0: 2624 tokens computed
    for 2589, against 2816)."""
    sizes = (32, 64, 128, 256, 512)
    ours, plain = 0, 0
    for seed in range(6):
        lengths = np.random.default_rng(seed).integers(16, 65, 64).tolist()
        calls = packs(lengths, sizes, prompts=16)
        assert sorted(i for call in calls for i in call) == list(range(64))
        assert all(len(call) <= 16 and sum(lengths[i] for i in call) <= 512 for call in calls)
        computed = _computed(calls, lengths, sizes)
        in_order = _computed(_in_order(lengths, 512, 16), lengths, sizes)
        assert computed <= in_order
        ours, plain = ours + computed, plain + in_order
    assert ours <= 0.96 * plain


def test_packs_split_a_call_that_would_pad_much():
    sizes = (16, 32, 64, 128, 256, 512)
    # 300 tokens: 256 + 64 computed, not 512.
    lengths = [64, 64, 64, 64, 44]
    calls = packs(lengths, sizes, prompts=16)
    assert len(calls) == 2 and _computed(calls, lengths, sizes) == 320
    # 110 tokens: 64 + 64 would save nothing against 128: one call.
    assert sorted(map(sorted, packs([60, 50], sizes, prompts=16))) == [[0, 1]]


def test_packs_keep_the_prompt_limit_and_run_a_long_prompt_alone():
    sizes = (16, 32, 64, 128)
    assert [len(call) for call in packs([10] * 7, sizes, prompts=3)] == [3, 3, 1]
    calls = packs([100, 40, 50, 30, 5, 128], sizes, prompts=3)
    assert calls[0] == [5]  # 128 tokens: a call of its own
    assert sorted(map(sorted, calls[1:])) == [[0, 4], [1, 2, 3]]  # 105 and 120 tokens


def test_layout_groups_prompts_by_adapter_and_pads():
    table = np.zeros(2, np.int32)
    jobs = [
        PrefillJob([1, 2, 3], table + 1, GREEDY, adapter_slot=1),
        PrefillJob([4], table + 2, WARM, adapter_slot=-1),
        PrefillJob([5, 6], table + 3, GREEDY, adapter_slot=1),
    ]
    call = layout(jobs, 8, 4, num_blocks=9, sampling=host_sampling(4, 64, 128))
    # Rows by slot (stable): job 1 (base), job 0, job 2; then an empty row.
    assert call.rows == [1, 0, 2]
    assert call.tokens.tolist() == [4, 1, 2, 3, 5, 6, 0, 0]
    assert call.starts.tolist() == [0, 1, 4, 6, 6]
    assert call.block_tables[:, 0].tolist() == [2, 1, 3, 9]
    assert call.sampling.temperature.tolist() == pytest.approx([0.8, 0.0, 0.0, 0.0])
    # Segments: the base prompt, then both slot-1 prompts as one; the rest empty.
    assert call.segments.slot.tolist() == [-1, 1, -1, -1]
    assert call.segments.start.tolist() == [0, 1, 6, 6, 6]
    # Segments of at most 2 rows: slot 1's five rows cut in three; room for 4 + 8 // 2.
    call = layout(jobs, 8, 4, num_blocks=9, window=2, sampling=host_sampling(4, 64, 128))
    assert (call.segments.slot.tolist(), call.segments.start.tolist()) == (
        [-1, 1, 1, 1, -1, -1, -1, -1],
        [0, 1, 3, 5, 6, 6, 6, 6, 6],
    )
    assert call.segments.window == 2


def test_the_default_prefill_many_is_prefill_per_job_and_reports_a_fault(monkeypatch):
    engine = MockEngine(max_slots=4, max_seq_len=64, max_loras=0)
    assert (engine.packed_prefill_tokens, engine.packed_prefill_prompts) == (0, 0)
    blocks = _Blocks(engine)
    jobs = [PrefillJob(_prompt(n, n), blocks.table(n), GREEDY) for n in (5, 9)]
    tokens = [result.token for result in engine.prefill_many(jobs)]
    assert tokens == [engine.prefill(job).token for job in jobs]
    _Spy(monkeypatch, engine, fail=lambda job: job is jobs[0])
    first, second = engine.prefill_many(jobs)
    assert (first.token, first.error.reason) == (-1, "CPU_ASSIST_FAILED")
    assert (second.token, second.error) == (tokens[1], None)
