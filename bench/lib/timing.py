"""Timing jlora's engine side by side: the benches' shared prompts and timed runs.

`make_prompts` gives the prompts (a fixed English passage, tiled), `jlora_decode`
times an engine's decode steps over them, `compare` runs several systems in turn
(one untimed round, then the timed ones, alternating, so background load hits each
alike) into `Measurement`s, and `write_report` writes them as JSON. `bench.throughput`
times transformers the same way; `bench.lora_decode`, `bench.prefill`,
`bench.step_profile` and `bench.sharding` time jlora's engines against each other,
so they need neither torch nor transformers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bench.lib import report
from jlora.engine.api import Request, SamplingParams
from jlora.engine.orchestrator import Orchestrator
from jlora.model.loading import LoadedModel

PASSAGE = (
    "The lighthouse keeper rose before dawn, as he had every morning for thirty years. "
    "He climbed the spiral stairs, trimmed the wick, polished the great lens until it "
    "shone, and wrote the weather in a leather logbook: wind from the north-west, a "
    "long swell, fog lifting by seven. Ships no longer needed him; their captains "
    "trusted satellites and radar. Yet fishermen still waved when they passed the "
    "point, and children from the village walked out on Sundays to ask him about the "
    "storms of his youth, the wreck of the schooner in 1962, and the night the light "
    "failed and he kept a lantern burning by hand until morning. "
)


GREEDY = SamplingParams()


@dataclasses.dataclass
class Measurement:
    system: str  # what ran: "jlora", "transformers", an engine variant
    phase: str  # "prefill" or "decode"
    shape: str  # "1xT" (prefill) or "Bx(L+N)" (decode)
    tokens: int  # tokens processed per repetition
    seconds: list[float] = dataclasses.field(default_factory=list)  # one per timed repetition

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / statistics.median(self.seconds)


def make_prompts(loaded: LoadedModel, batch: int, length: int) -> list[list[int]]:
    """`batch` prompts of exactly `length` token ids, row r starting r * 7 tokens in; for
    a model without a tokenizer (a random-weight preset), seeded random ids."""
    if loaded.tokenizer is None:
        ids = np.random.default_rng(0).integers(1, loaded.config.vocab_size, (batch, length))
        return ids.tolist()
    passage = loaded.tokenizer.encode(PASSAGE)
    stream = passage * ((length + 7 * batch) // len(passage) + 1)
    return [stream[7 * row : 7 * row + length] for row in range(batch)]


def jlora_decode(
    engine: Orchestrator,
    prompts: list[list[int]],
    new_tokens: int,
    adapters: list[str | None] | None = None,
    around: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    sampling: SamplingParams = GREEDY,
) -> float:
    """Seconds for N decode steps of `prompts` (prompt i with adapters[i]), after an
    untimed first step that prefills them all; `around()` is entered for the N steps
    alone (a profiler's trace); `sampling`: the requests' (greedy by default; its
    max_tokens and ignore_eos are set here)."""
    # Each request yields one token at prefill, one at the untimed first decode, then N.
    sampling = dataclasses.replace(sampling, max_tokens=new_tokens + 2, ignore_eos=True)
    for prompt, adapter in zip(prompts, adapters or [None] * len(prompts), strict=True):
        engine.add_request(Request(uuid.uuid4().hex, prompt, sampling, adapter=adapter))
    engine.step()
    if engine.num_running != len(prompts):
        raise RuntimeError(
            f"only {engine.num_running} of {len(prompts)} requests were admitted "
            f"in one step; raise prefill_token_budget or shorten the prompts"
        )
    generated = 0
    with around():
        start = time.perf_counter()
        while engine.has_unfinished:
            generated += len(engine.step())
        elapsed = time.perf_counter() - start
    assert generated == len(prompts) * new_tokens, generated
    return elapsed


def compare(
    phase: str, shape: str, tokens: int, repeats: int, **runs: Callable[[], float]
) -> list[Measurement]:
    """Run every system once untimed, then `repeats` times timed, alternating systems."""
    print(f"  {phase} {shape}", file=sys.stderr, flush=True)
    results = {system: Measurement(system, phase, shape, tokens) for system in runs}
    for repeat in range(repeats + 1):
        for system, run in runs.items():
            seconds = run()
            if repeat:
                results[system].seconds.append(seconds)
    return list(results.values())


def write_report(path: Path, facts: dict, plan, measurements: list[Measurement]) -> None:
    """The raw results as JSON: machine facts, the plan (a dataclass) and every timing."""
    rows = [{**dataclasses.asdict(m), "tokens_per_s": m.tokens_per_s} for m in measurements]
    report.write_report(path, facts, plan, rows)
