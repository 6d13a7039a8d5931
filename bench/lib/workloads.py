"""Serving workloads: who asks for what, and when, replayed against a running server.

A `Workload` is a list of `WorkloadRequest`s, each with an arrival time (seconds after
the replay starts), a text prompt of a known token length, the number of tokens to
generate and the adapter it asks for (None: the base model). `bench.lib.harness` sends
every request at its arrival time, whatever the server answers (open loop).

How one is made:

1. Arrivals and lengths: `poisson_workload` draws exponential inter-arrival times at a
   fixed rate and uniform prompt/output lengths; `azure_workload` replays a window of
   the Azure LLM inference trace 2023 (`DATA_DIR`, see its README.md): the real
   inter-arrival times, divided by `rate_scale` (2 replays the window twice as fast),
   and the real lengths, multiplied by `prompt_scale` / `output_scale` and clipped.
2. Adapters: the trace names none, so each request draws one from a pool with Zipf
   popularity (weight of the k-th adapter ∝ 1 / k**zipf_s, the first the most popular),
   or the base model with probability `base_fraction`, as the CaraServe and Toppings
   papers do. `demo_adapter_pool` names the pool as `jlora adapters make-demo` writes it
   (`demo-00-r8`, `demo-01-r16`, ...), so a benchmark can serve real adapters by those
   names.
3. Prompts: the trace has no text. `PromptSynthesizer` writes a deterministic string of
   common English words that the target's tokenizer encodes to the wanted number of
   tokens (see its docstring for when that is exact).

Conversations: `multiturn_workload` makes `Turn`s instead of requests, sessions of a
few turns each synthesised over the Azure trace's arrivals (its docstring says how). A
turn's prompt holds the model's earlier answers, so it is assembled by the harness at
send time, after the session's previous turn has finished (bench/cache.py).

Each part draws from its own seeded stream (`numpy.random.default_rng([seed, part])`),
so the same seed gives the same workload, and changing the adapter pool leaves the
arrivals and prompts as they were. `meta` records every generation parameter.

File format (JSONL): a header line `{"format": "jlora-workload", "version": 1, "meta":
{...}}`, then one request per line with exactly the keys id, arrival_s, prompt,
prompt_tokens, max_tokens, adapter, rank. `prompt`, `adapter` and `max_tokens` mean
what they mean in a `jlora generate --prompts-file` JSONL file.

CLI: `python -m bench.workloads azure --trace code --duration 60 --out W.jsonl` or
`python -m bench.workloads poisson --rate 4 --num-requests 200 --out W.jsonl`.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

DATA_DIR = Path(__file__).resolve().parents[1] / "data" / "azure-llm-inference-2023"  # CC BY 4.0
TRACES = ("code", "conv")
FORMAT, VERSION = "jlora-workload", 1
REQUEST_KEYS = ("id", "arrival_s", "prompt", "prompt_tokens", "max_tokens", "adapter", "rank")
DEFAULT_RANKS = (8, 16, 32, 64)

# Seed streams, one per part of a workload (`default_rng([seed, part])`).
_ARRIVALS, _LENGTHS, _ADAPTERS, _PROMPTS, _SESSIONS = range(5)

# Common English words: most are one token in any BPE vocabulary of English text.
_COMMON_WORDS = """
    the of and to in is was he for it with as his on be at by had are but from or have an
    they which one you were her all she there would their we him been has when who will
    more no if out so said what up its about into than them can only other new some could
    time these two may then do first any my now such like our over man me even most made
    after also did many before must through back years where much your way well down
    should because each just those people how too little state good very make world still
    own see men work long get here between both life being under never day same another
    know while last might us great old year off come since against go came right used take
    three states himself few house use during without again place around however home
    small found thought went say part once general high upon school every does got united
    left number course war until always away something fact though water less public put
    think almost hand enough far took head yet government system better set told nothing
    night end why called didn find look asked later knew point city next program business
    give group toward young days let room president side social given present several order"""
WORDS = tuple(_COMMON_WORDS.split())


class WorkloadError(ValueError):
    """A workload or one of its parameters is invalid; the message names the field."""


class TextTokenizer(Protocol):
    """What prompt synthesis needs of a tokenizer (jlora.tokenizer.Tokenizer has it)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


# -- the workload --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class WorkloadRequest:
    """One request: sent `arrival_s` seconds after the replay starts.

    `prompt_tokens` is the prompt's length in the workload tokenizer's tokens;
    `max_tokens` the tokens to generate (the harness sets ignore_eos, so exactly these);
    `adapter` None with `rank` 0 is the base model, else an adapter name and its rank.
    """

    id: str
    arrival_s: float
    prompt: str
    prompt_tokens: int
    max_tokens: int
    adapter: str | None
    rank: int

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise WorkloadError(f"id={self.id!r} must be a non-empty string")
        arrival = self.arrival_s
        if isinstance(arrival, bool) or not isinstance(arrival, int | float):
            raise WorkloadError(f"arrival_s={arrival!r} must be a number of seconds")
        if not (math.isfinite(arrival) and arrival >= 0):
            raise WorkloadError(f"arrival_s={arrival!r} must be finite and >= 0")
        if not isinstance(self.prompt, str) or not self.prompt:
            raise WorkloadError(f"prompt={self.prompt!r} must be a non-empty string")
        for field in ("prompt_tokens", "max_tokens"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise WorkloadError(f"{field}={value!r} must be a positive integer")
        if self.adapter is not None and (not isinstance(self.adapter, str) or not self.adapter):
            raise WorkloadError(
                f"adapter={self.adapter!r} must be an adapter name or null (the base model)"
            )
        rank = self.rank
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise WorkloadError(f"rank={rank!r} must be an integer")
        if self.adapter is None and rank != 0:
            raise WorkloadError(f"rank={rank}: the base model (adapter null) has rank 0")
        if self.adapter is not None and rank < 1:
            raise WorkloadError(f"rank={rank}: adapter {self.adapter!r} needs a positive rank")


@dataclasses.dataclass(frozen=True)
class Workload:
    """Requests in arrival order, and `meta`: how they were made (JSON-serialisable)."""

    meta: dict[str, Any]
    requests: tuple[WorkloadRequest, ...]

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        header = {"format": FORMAT, "version": VERSION, "meta": self.meta}
        lines = [json.dumps(header, ensure_ascii=False)]
        lines += [
            json.dumps(dataclasses.asdict(request), ensure_ascii=False) for request in self.requests
        ]
        path.write_text("\n".join(lines) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> Workload:
        """Read a `save`d file; WorkloadError names the line and the field at fault."""
        path = Path(path)
        lines = path.read_text().splitlines()
        if not lines:
            raise WorkloadError(f"{path}: empty file (expected a {FORMAT} header line)")
        header = _json_object(path, 1, lines[0])
        if header.get("format") != FORMAT or header.get("version") != VERSION:
            raise WorkloadError(
                f"{path}:1: format={header.get('format')!r} version={header.get('version')!r}: "
                f"expected a {FORMAT} version {VERSION} header"
            )
        if not isinstance(header.get("meta"), dict):
            raise WorkloadError(f"{path}:1: meta={header.get('meta')!r} must be an object")
        requests, seen = [], set()
        for lineno, line in enumerate(lines[1:], start=2):
            if not line.strip():
                continue
            fields = _json_object(path, lineno, line)
            missing = [key for key in REQUEST_KEYS if key not in fields]
            unknown = sorted(set(fields) - set(REQUEST_KEYS))
            if missing or unknown:
                problems = [f"{what} fields {', '.join(keys)}" for what, keys in
                            (("missing", missing), ("unknown", unknown)) if keys]  # fmt: skip
                raise WorkloadError(
                    f"{path}:{lineno}: {'; '.join(problems)} (a request has exactly "
                    f"{', '.join(REQUEST_KEYS)})"
                )
            try:
                request = WorkloadRequest(**fields)
            except WorkloadError as err:
                raise WorkloadError(f"{path}:{lineno}: {err}") from None
            if request.id in seen:
                raise WorkloadError(f"{path}:{lineno}: id={request.id!r} is used twice")
            seen.add(request.id)
            requests.append(request)
        return cls(header["meta"], tuple(requests))


def _json_object(path: Path, lineno: int, line: str) -> dict[str, Any]:
    try:
        value = json.loads(line)
    except json.JSONDecodeError as err:
        raise WorkloadError(f"{path}:{lineno}: not JSON ({err.msg})") from None
    if not isinstance(value, dict):
        raise WorkloadError(f"{path}:{lineno}: expected a JSON object, got {value!r:.60}")
    return value


# -- adapters ------------------------------------------------------------------------


def demo_adapter_pool(n: int, ranks: Sequence[int] = DEFAULT_RANKS) -> list[tuple[str, int]]:
    """(name, rank) of the `n` adapters `jlora.adapters.peft.make_demo_adapters` writes
    with these `ranks`: `demo-{i:02d}-r{rank}`, ranks cycling."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise WorkloadError(f"n={n!r} must be a non-negative integer")
    ranks = tuple(ranks)
    if not ranks or any(isinstance(r, bool) or not isinstance(r, int) or r < 1 for r in ranks):
        raise WorkloadError(f"ranks={ranks!r} must be positive integers (at least one)")
    return [(f"demo-{i:02d}-r{ranks[i % len(ranks)]}", ranks[i % len(ranks)]) for i in range(n)]


def zipf_weights(n: int, s: float) -> np.ndarray:
    """Probabilities ∝ 1 / k**s for k = 1..n (s = 0: uniform)."""
    weights = 1.0 / np.arange(1, n + 1, dtype=float) ** s
    return weights / weights.sum()


def assign_adapters(
    count: int,
    adapters: Sequence[tuple[str, int]],
    *,
    zipf_s: float,
    base_fraction: float,
    rng: np.random.Generator,
) -> list[tuple[str | None, int]]:
    """(adapter, rank) per request: the base model (None, 0) with probability
    `base_fraction`, else an adapter drawn with Zipf(`zipf_s`) popularity, `adapters[0]`
    the most popular. With no adapters every request is for the base model."""
    if not (isinstance(zipf_s, int | float) and math.isfinite(zipf_s) and zipf_s >= 0):
        raise WorkloadError(f"zipf_s={zipf_s!r} must be a finite number >= 0")
    if not (isinstance(base_fraction, int | float) and 0 <= base_fraction <= 1):
        raise WorkloadError(f"base_fraction={base_fraction!r} must be in [0, 1]")
    if not adapters:
        return [(None, 0)] * count
    base = rng.random(count) < base_fraction
    picks = rng.choice(len(adapters), size=count, p=zipf_weights(len(adapters), zipf_s))
    return [(None, 0) if is_base else adapters[k] for is_base, k in zip(base, picks, strict=True)]


# -- prompts -------------------------------------------------------------------------


class PromptSynthesizer:
    """Deterministic prompts of a given token length for one tokenizer.

    A prompt is words drawn with the caller's generator and joined by spaces: those of
    `WORDS` that the tokenizer encodes as one token after a space (all of `WORDS` if
    fewer than half are). It is then fitted: encode, cut the ids to the wanted length,
    decode, encode again, and append words while it is short, until the count is right
    (at most `max_rounds` encodes; then the closest text seen). With a tokenizer that
    splits on whitespace before merging (byte-level BPE: SmolLM2, Llama-3, GPT-2) and
    decodes what it encodes, the first draw or the first cut is exact (tests check
    SmolLM2's for every length from 1 to 300). A tokenizer that prepends a BOS counts
    it, so a length of 1 is then out of reach; `make` returns the count it reached.
    """

    def __init__(self, tokenizer: TextTokenizer, *, max_rounds: int = 8) -> None:
        self.tokenizer = tokenizer
        self.max_rounds = max_rounds
        empty = len(tokenizer.encode(""))  # a BOS, if the tokenizer adds one
        single = [word for word in WORDS if len(tokenizer.encode(f" {word}")) == empty + 1]
        self.words = tuple(single) if 2 * len(single) >= len(WORDS) else WORDS

    def __call__(self, n_tokens: int, rng: np.random.Generator) -> str:
        return self.make(n_tokens, rng)[0]

    def make(self, n_tokens: int, rng: np.random.Generator) -> tuple[str, int]:
        """(prompt, its length in tokens), the length `n_tokens` where reachable."""
        if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 1:
            raise WorkloadError(f"n_tokens={n_tokens!r} must be a positive integer")
        text = self._words(n_tokens, rng)
        best, best_length, best_gap = text, 0, math.inf
        for _ in range(self.max_rounds):
            ids = self.tokenizer.encode(text)
            if abs(len(ids) - n_tokens) < best_gap:
                best, best_length, best_gap = text, len(ids), abs(len(ids) - n_tokens)
            if len(ids) == n_tokens:
                break
            if len(ids) > n_tokens:
                text = self.tokenizer.decode(ids[:n_tokens]).strip()
            else:
                text = f"{text} {self._words(n_tokens - len(ids), rng)}"
            if not text:  # the cut kept only special tokens (a BOS)
                text = self._words(1, rng)
        return best, best_length

    def _words(self, count: int, rng: np.random.Generator) -> str:
        return " ".join(self.words[k] for k in rng.integers(0, len(self.words), count))


class WordTokenizer:
    """One token per word of `WORDS`, its index the id: the tokenizer of a workload for a
    model that has none (a random-weight preset such as llama2-7b). Such a workload's
    prompts are words, and a client sends `encode(prompt)` as token ids
    (`bench.serve --word-ids`), so every prompt is exactly `prompt_tokens` ids."""

    _IDS = {word: index for index, word in enumerate(WORDS)}

    def encode(self, text: str) -> list[int]:
        try:
            return [self._IDS[word] for word in text.split()]
        except KeyError as err:
            raise WorkloadError(f"prompt word {err.args[0]!r} is not one of WORDS") from None

    def decode(self, ids: list[int]) -> str:
        return " ".join(WORDS[index] for index in ids)


def synth_prompt(tokenizer: TextTokenizer, n_tokens: int, rng: np.random.Generator) -> str:
    """A prompt that `tokenizer` encodes to `n_tokens` tokens (see PromptSynthesizer)."""
    return PromptSynthesizer(tokenizer)(n_tokens, rng)


# -- generators ----------------------------------------------------------------------


def _build(
    meta: dict[str, Any],
    arrivals: Sequence[float],
    prompt_lengths: Sequence[int],
    output_lengths: Sequence[int],
    *,
    adapters: Sequence[tuple[str, int]],
    zipf_s: float,
    base_fraction: float,
    seed: int,
    tokenizer: TextTokenizer,
) -> Workload:
    """Adapters and prompts for given arrivals and lengths; the shared last step."""
    adapters = [(str(name), int(rank)) for name, rank in adapters]
    picks = assign_adapters(
        len(arrivals),
        adapters,
        zipf_s=zipf_s,
        base_fraction=base_fraction,
        rng=np.random.default_rng([seed, _ADAPTERS]),
    )
    synth, prompt_rng = PromptSynthesizer(tokenizer), np.random.default_rng([seed, _PROMPTS])
    width = len(str(max(len(arrivals) - 1, 0)))
    requests = []
    for i, (arrival, n_prompt, n_output, (adapter, rank)) in enumerate(
        zip(arrivals, prompt_lengths, output_lengths, picks, strict=True)
    ):
        prompt, prompt_length = synth.make(int(n_prompt), prompt_rng)
        requests.append(
            WorkloadRequest(
                id=f"r{i:0{width}d}",
                arrival_s=round(float(arrival), 6),
                prompt=prompt,
                prompt_tokens=prompt_length,
                max_tokens=int(n_output),
                adapter=adapter,
                rank=rank,
            )
        )
    meta = {
        **meta,
        "adapters": [list(pair) for pair in adapters],
        "zipf_s": zipf_s,
        "base_fraction": base_fraction,
        "seed": seed,
        "tokenizer": type(tokenizer).__name__,
        "requests": len(requests),
    }
    return Workload(meta, tuple(requests))


def _check_bounds(name: str, bounds: tuple[int, int]) -> tuple[int, int]:
    low, high = bounds
    if not (isinstance(low, int) and isinstance(high, int) and 1 <= low <= high):
        raise WorkloadError(f"{name}={bounds!r} must be integers with 1 <= low <= high")
    return low, high


def poisson_workload(
    *,
    rate_per_s: float,
    duration_s: float | None = None,
    num_requests: int | None = None,
    prompt_tokens: tuple[int, int] = (64, 512),
    output_tokens: tuple[int, int] = (16, 256),
    adapters: Sequence[tuple[str, int]] = (),
    zipf_s: float = 1.0,
    base_fraction: float = 0.0,
    seed: int = 0,
    tokenizer: TextTokenizer,
) -> Workload:
    """Poisson arrivals at `rate_per_s` for `duration_s` seconds or `num_requests`
    requests (exactly one of them); lengths uniform over the inclusive ranges."""
    if not (isinstance(rate_per_s, int | float) and math.isfinite(rate_per_s) and rate_per_s > 0):
        raise WorkloadError(f"rate_per_s={rate_per_s!r} must be a positive number")
    if (duration_s is None) == (num_requests is None):
        raise WorkloadError(
            f"duration_s={duration_s!r}, num_requests={num_requests!r}: give exactly one"
        )
    prompt_tokens = _check_bounds("prompt_tokens", prompt_tokens)
    output_tokens = _check_bounds("output_tokens", output_tokens)
    arrival_rng = np.random.default_rng([seed, _ARRIVALS])
    if num_requests is not None:
        if isinstance(num_requests, bool) or not isinstance(num_requests, int) or num_requests < 0:
            raise WorkloadError(f"num_requests={num_requests!r} must be a non-negative integer")
        arrivals = np.cumsum(arrival_rng.exponential(1 / rate_per_s, num_requests))
    else:
        if not (isinstance(duration_s, int | float) and duration_s > 0):
            raise WorkloadError(f"duration_s={duration_s!r} must be a positive number")
        arrivals = []
        now = arrival_rng.exponential(1 / rate_per_s)
        while now < duration_s:
            arrivals.append(now)
            now += arrival_rng.exponential(1 / rate_per_s)
    count = len(arrivals)
    length_rng = np.random.default_rng([seed, _LENGTHS])
    meta = {
        "kind": "poisson",
        "rate_per_s": rate_per_s,
        "duration_s": duration_s,
        "num_requests": num_requests,
        "prompt_tokens": list(prompt_tokens),
        "output_tokens": list(output_tokens),
    }
    return _build(
        meta,
        arrivals,
        length_rng.integers(prompt_tokens[0], prompt_tokens[1] + 1, count),
        length_rng.integers(output_tokens[0], output_tokens[1] + 1, count),
        adapters=adapters,
        zipf_s=zipf_s,
        base_fraction=base_fraction,
        seed=seed,
        tokenizer=tokenizer,
    )


@dataclasses.dataclass(frozen=True)
class TraceRows:
    """An Azure trace: arrival seconds after its first request, and lengths."""

    arrival_s: np.ndarray  # f64[N], non-decreasing, arrival_s[0] == 0
    context_tokens: np.ndarray  # i64[N]
    generated_tokens: np.ndarray  # i64[N]


def read_trace(trace: str, data_dir: str | Path = DATA_DIR) -> TraceRows:
    """`data_dir/{trace}.csv` (TIMESTAMP,ContextTokens,GeneratedTokens)."""
    if trace not in TRACES:
        raise WorkloadError(f"trace={trace!r} must be one of {TRACES}")
    path = Path(data_dir) / f"{trace}.csv"
    if not path.is_file():
        raise WorkloadError(f"{path}: no such file (data_dir={str(data_dir)!r})")
    seconds, context, generated = [], [], []
    with path.open(newline="") as handle:
        rows = csv.DictReader(handle)
        for lineno, row in enumerate(rows, start=2):
            try:
                seconds.append(_timestamp_s(row["TIMESTAMP"]))
                context.append(int(row["ContextTokens"]))
                generated.append(int(row["GeneratedTokens"]))
            except (KeyError, TypeError, ValueError) as err:
                raise WorkloadError(f"{path}:{lineno}: bad row {row} ({err})") from None
    if not seconds:
        raise WorkloadError(f"{path}: no requests in the trace")
    arrival = np.asarray(seconds) - seconds[0]
    if np.any(np.diff(arrival) < 0):
        raise WorkloadError(f"{path}: TIMESTAMP is not in arrival order")
    return TraceRows(arrival, np.asarray(context), np.asarray(generated))


_EPOCH = datetime.datetime(2000, 1, 1)


def _timestamp_s(stamp: str) -> float:
    """'2023-11-16 18:17:03.9799600' as seconds since 2000 (every fraction digit kept)."""
    whole, _, fraction = stamp.partition(".")
    seconds = (datetime.datetime.fromisoformat(whole) - _EPOCH).total_seconds()
    return seconds + (float(f"0.{fraction}") if fraction else 0.0)


def azure_workload(
    *,
    trace: str = "code",
    start_s: float = 0.0,
    duration_s: float | None = None,
    rate_scale: float = 1.0,
    max_requests: int | None = None,
    prompt_scale: float = 1.0,
    output_scale: float = 1.0,
    prompt_tokens: tuple[int, int] = (1, 1536),
    output_tokens: tuple[int, int] = (1, 512),
    adapters: Sequence[tuple[str, int]] = (),
    zipf_s: float = 1.0,
    base_fraction: float = 0.0,
    seed: int = 0,
    tokenizer: TextTokenizer,
    data_dir: str | Path = DATA_DIR,
) -> Workload:
    """The requests of the trace window [start_s, start_s + duration_s) (trace seconds
    after its first request; duration None: to the end), at most `max_requests` of them.

    arrival_s = (trace time - start_s) / rate_scale: the window replays in
    duration_s / rate_scale seconds with the trace's inter-arrival times compressed.
    Lengths: round(ContextTokens * prompt_scale) clipped to `prompt_tokens`,
    round(GeneratedTokens * output_scale) clipped to `output_tokens` (the defaults keep
    prompt + output within a 2048-token context).
    """
    scales = {"rate_scale": rate_scale, "prompt_scale": prompt_scale, "output_scale": output_scale}
    for name, value in scales.items():
        if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
            raise WorkloadError(f"{name}={value!r} must be a positive number")
    if not (isinstance(start_s, int | float) and start_s >= 0):
        raise WorkloadError(f"start_s={start_s!r} must be a number >= 0")
    if duration_s is not None and not (isinstance(duration_s, int | float) and duration_s > 0):
        raise WorkloadError(f"duration_s={duration_s!r} must be a positive number or None")
    if max_requests is not None and (not isinstance(max_requests, int) or max_requests < 0):
        raise WorkloadError(f"max_requests={max_requests!r} must be a non-negative integer")
    prompt_tokens = _check_bounds("prompt_tokens", prompt_tokens)
    output_tokens = _check_bounds("output_tokens", output_tokens)
    rows = read_trace(trace, data_dir)
    end = math.inf if duration_s is None else start_s + duration_s
    window = np.flatnonzero((rows.arrival_s >= start_s) & (rows.arrival_s < end))
    window = window[:max_requests]
    prompts = np.clip(np.rint(rows.context_tokens[window] * prompt_scale), *prompt_tokens)
    outputs = np.clip(np.rint(rows.generated_tokens[window] * output_scale), *output_tokens)
    meta = {
        "kind": "azure",
        "trace": trace,
        "data_dir": str(data_dir),
        "start_s": start_s,
        "duration_s": duration_s,
        "rate_scale": rate_scale,
        "max_requests": max_requests,
        "prompt_scale": prompt_scale,
        "output_scale": output_scale,
        "prompt_tokens": list(prompt_tokens),
        "output_tokens": list(output_tokens),
        "first_trace_row": int(window[0]) if len(window) else None,
    }
    return _build(
        meta,
        (rows.arrival_s[window] - start_s) / rate_scale,
        prompts.astype(int),
        outputs.astype(int),
        adapters=adapters,
        zipf_s=zipf_s,
        base_fraction=base_fraction,
        seed=seed,
        tokenizer=tokenizer,
    )


# -- multi-turn sessions -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Turn:
    """One turn of a conversation: a new user message, answered in `max_tokens` tokens.

    The prompt is not here, because it holds the model's earlier answers: the harness
    sends turn k once turn k-1 has finished, its prompt turn k-1's prompt, then the
    tokens turn k-1 generated, then `message` encoded (ids concatenated, not text, so
    each prompt extends the previous one exactly). `context_tokens` is that prompt's
    length when every answer has exactly its max_tokens tokens (the harness sets
    ignore_eos) and `message` encodes to `message_tokens` ids. `arrival_s` is the
    earliest the turn may be sent (its trace arrival); the harness sends it at
    max(arrival_s, the previous turn's finish + the workload's think_s).
    """

    id: str  # f"{session}-t{index}"
    session: str
    index: int  # 0 opens the session
    arrival_s: float
    message: str
    message_tokens: int
    max_tokens: int
    context_tokens: int
    adapter: str | None  # the session's; None with rank 0 is the base model
    rank: int


@dataclasses.dataclass(frozen=True)
class MultiTurnWorkload:
    """Turns in arrival order (a session's in turn order), the think time between a
    turn's answer and its session's next turn, and `meta`: how they were made."""

    meta: dict[str, Any]
    turns: tuple[Turn, ...]
    think_s: float

    def sessions(self) -> dict[str, tuple[Turn, ...]]:
        """Each session's turns in order, sessions in the order they open."""
        sessions: dict[str, list[Turn]] = {}
        for turn in self.turns:
            sessions.setdefault(turn.session, []).append(turn)
        return {name: tuple(turns) for name, turns in sessions.items()}


def multiturn_workload(
    *,
    trace: str = "conv",
    start_s: float = 0.0,
    duration_s: float | None = None,
    rate_scale: float = 1.0,
    max_turns: int | None = None,
    message_scale: float = 0.1,
    output_scale: float = 0.25,
    message_tokens: tuple[int, int] = (8, 256),
    output_tokens: tuple[int, int] = (8, 128),
    continue_p: float = 0.7,
    mean_turns: float = 4.0,
    max_context_tokens: int = 2048,
    think_s: float = 1.0,
    adapters: Sequence[tuple[str, int]] = (),
    zipf_s: float = 1.0,
    base_fraction: float = 0.0,
    seed: int = 0,
    tokenizer: TextTokenizer,
    data_dir: str | Path = DATA_DIR,
) -> MultiTurnWorkload:
    """Conversations (FastLibra §6.2's chatbot scenario) over a window of the Azure trace.

    The trace has no conversations, so they are synthesised. Each request of the window
    (`azure_workload` with these trace, window and rate arguments) is one turn: its
    arrival, a new user message of round(ContextTokens * message_scale) tokens and an
    answer of round(GeneratedTokens * output_scale), clipped to `message_tokens` and
    `output_tokens`. In arrival order, a turn continues an open session with
    probability `continue_p` (one of the open sessions, uniformly), else it opens a
    new one. A session is open until it has had its number of turns, drawn when it
    opens from a geometric distribution of mean `mean_turns` (at least 1), or until its
    next turn would take its context (`Turn.context_tokens` + max_tokens) past
    `max_context_tokens`: that turn then opens a new session instead. A session's
    adapter is drawn when it opens, as `assign_adapters` draws a request's: Zipf
    (`zipf_s`) over `adapters`, the base model with probability `base_fraction`.

    Seeded streams (the module docstring): the messages are the window's prompts (the
    `_PROMPTS` stream), the sessions' shapes draw from `_SESSIONS`, their adapters from
    `_ADAPTERS`, so the adapter pool changes neither messages nor sessions.
    """
    if max_turns is not None and (
        isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 0
    ):
        raise WorkloadError(f"max_turns={max_turns!r} must be a non-negative integer or None")
    for name, value in {"continue_p": continue_p, "think_s": think_s}.items():
        if not (_is_number(value) and value >= 0):
            raise WorkloadError(f"{name}={value!r} must be a finite number >= 0")
    if continue_p >= 1:
        raise WorkloadError(f"continue_p={continue_p!r} must be below 1 (1: one endless session)")
    if not (_is_number(mean_turns) and mean_turns >= 1):
        raise WorkloadError(f"mean_turns={mean_turns!r} must be a finite number >= 1")
    message_tokens = _check_bounds("message_tokens", message_tokens)
    output_tokens = _check_bounds("output_tokens", output_tokens)
    if isinstance(max_context_tokens, bool) or not isinstance(max_context_tokens, int):
        raise WorkloadError(f"max_context_tokens={max_context_tokens!r} must be an integer")
    if max_context_tokens < message_tokens[1] + output_tokens[1]:
        raise WorkloadError(
            f"max_context_tokens={max_context_tokens} must hold a first turn: the longest "
            f"message and answer need {message_tokens[1] + output_tokens[1]}"
        )
    window = azure_workload(
        trace=trace,
        start_s=start_s,
        duration_s=duration_s,
        rate_scale=rate_scale,
        max_requests=max_turns,
        prompt_scale=message_scale,
        output_scale=output_scale,
        prompt_tokens=message_tokens,
        output_tokens=output_tokens,
        seed=seed,
        tokenizer=tokenizer,
        data_dir=data_dir,
    )
    rng = np.random.default_rng([seed, _SESSIONS])
    # Per session: turns left, turns had, context so far (messages and answers, tokens).
    left: list[int] = []
    had: list[int] = []
    context: list[int] = []
    open_sessions: list[int] = []
    placed: list[tuple[int, int, int]] = []  # per turn: session, index, context_tokens
    for request in window.requests:
        session = -1
        if open_sessions and rng.random() < continue_p:
            session = open_sessions[rng.integers(len(open_sessions))]
            if context[session] + request.prompt_tokens + request.max_tokens > max_context_tokens:
                open_sessions.remove(session)  # full: this turn opens a new session
                session = -1
        if session < 0:
            session = len(left)
            left.append(int(rng.geometric(1 / mean_turns)))
            had.append(0)
            context.append(0)
            open_sessions.append(session)
        context[session] += request.prompt_tokens
        placed.append((session, had[session], context[session]))
        context[session] += request.max_tokens
        had[session] += 1
        left[session] -= 1
        if not left[session]:
            open_sessions.remove(session)
    picks = assign_adapters(
        len(left),
        [(str(name), int(rank)) for name, rank in adapters],
        zipf_s=zipf_s,
        base_fraction=base_fraction,
        rng=np.random.default_rng([seed, _ADAPTERS]),
    )
    width = len(str(max(len(left) - 1, 0)))
    turns = []
    for request, (session, index, context_tokens) in zip(window.requests, placed, strict=True):
        name = f"s{session:0{width}d}"
        adapter, rank = picks[session]
        turns.append(
            Turn(
                id=f"{name}-t{index}",
                session=name,
                index=index,
                arrival_s=request.arrival_s,
                message=request.prompt,
                message_tokens=request.prompt_tokens,
                max_tokens=request.max_tokens,
                context_tokens=context_tokens,
                adapter=adapter,
                rank=rank,
            )
        )
    meta = {
        "kind": "multiturn",
        **{key: window.meta[key] for key in _FROM_WINDOW},
        "max_turns": max_turns,
        "message_scale": message_scale,
        "message_tokens": list(message_tokens),
        "continue_p": continue_p,
        "mean_turns": mean_turns,
        "max_context_tokens": max_context_tokens,
        "think_s": think_s,
        "adapters": [[str(name), int(rank)] for name, rank in adapters],
        "zipf_s": zipf_s,
        "base_fraction": base_fraction,
        "turns": len(turns),
        "sessions": len(left),
        "longest_context_tokens": max((t.context_tokens for t in turns), default=0),
    }
    return MultiTurnWorkload(meta, tuple(turns), float(think_s))


# What a multi-turn workload's meta takes from its window's (azure_workload's).
_FROM_WINDOW = (
    "trace", "data_dir", "start_s", "duration_s", "rate_scale", "output_scale",
    "output_tokens", "first_trace_row", "seed", "tokenizer",
)  # fmt: skip


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


# -- tokenizers ----------------------------------------------------------------------


def load_tokenizer(spec: str) -> TextTokenizer:
    """The tokenizer of a model preset with a GGUF file, a .gguf file or a model
    directory with tokenizer.json, without loading any weights; "words": WordTokenizer."""
    if spec == "words":
        return WordTokenizer()
    from configs import list_presets, load_preset
    from jlora.model.gguf import GGUFFile
    from jlora.tokenizer import Tokenizer

    path = Path(spec)
    if spec in list_presets():
        weights = load_preset(spec).weights
        if weights.format != "gguf":
            raise WorkloadError(
                f"tokenizer={spec!r}: this preset has random weights, no tokenizer "
                "(use --tokenizer words)"
            )
        path = weights.resolve_path()
    if path.is_dir():
        return Tokenizer.from_dir(path)
    if path.suffix == ".gguf" and path.is_file():
        return Tokenizer.from_gguf_fields(GGUFFile(path).fields)
    raise WorkloadError(
        f"tokenizer={spec!r} is neither a preset ({', '.join(list_presets())}), a .gguf file "
        "nor a directory with tokenizer.json"
    )
