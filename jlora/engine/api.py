"""The request-level types of the engine: what the CLI, the server and the tests send
to the orchestrator and get back from it.

A `Request` is queued with `Orchestrator.add_request`; each `step()` returns the
`TokenEvent`s it produced; `stats()` and `adapter_infos()` are snapshots between two
steps. A request's host state is a plain value (`SequenceState`), so it can be taken
out of one orchestrator (`export`) and resumed in another (`resume`) with the same
tokens. Failures are `jlora.contract.errors.RequestError`s, raised where they are
found and naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time

from jlora.contract.adapters import Adapter
from jlora.contract.errors import InvalidRequest, RequestError

MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 16
MAX_LOGIT_BIAS = 300  # the most tokens one request's logit_bias names (OpenAI's limit)
MAX_LOGPROBS = 20  # the most top log-probabilities a position reports (OpenAI's limit)

# TokenEvent.finish_reason
STOP, LENGTH, ERROR = "stop", "length", "error"
# AdapterInfo.state
HOST, LOADING, DEVICE = "host", "loading", "device"


STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclasses.dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the text a request generates (engine/grammar.py): kind
    "json_schema" (spec: the schema, as JSON text), "json_object" (any JSON object),
    "regex" (spec: the pattern the whole text matches), "choice" (exactly one of
    `choices`), or "grammar" (spec: a Lark grammar, llguidance's dialect)."""

    kind: str
    spec: str = ""
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        field = "sampling.structured"
        if self.kind not in STRUCTURED_KINDS:
            raise InvalidRequest(
                f"structured output kind={self.kind!r} is not one of {list(STRUCTURED_KINDS)}",
                field=field,
            )
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.spec)
            except ValueError as err:
                raise InvalidRequest(f"the JSON schema is not JSON ({err})", field=field) from None
            if not isinstance(schema, dict | bool):
                raise InvalidRequest("the JSON schema must be an object", field=field)
        if self.kind in ("regex", "grammar") and not self.spec:
            raise InvalidRequest(f"structured output {self.kind} is empty", field=field)
        if self.kind == "choice" and (not self.choices or not all(self.choices)):
            raise InvalidRequest("a choice needs non-empty strings to choose from", field=field)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature 0 is greedy decoding; top_k 0 and top_p 1 disable those cuts;
    seed None draws a fresh seed for the request. A request stops at the first of:
    an end-of-sequence token (unless ignore_eos) or one of stop_token_ids, a stop string
    (excluded from the text unless include_stop_str_in_output), max_tokens generated, or
    the engine's max_seq_len. Neither a stop token nor a stop string ends it before
    min_tokens are generated (the stop tokens cannot be sampled until then).

    The logits are adjusted in vLLM's order before the cuts: logit_bias (token id, bias
    added) and min_tokens; then the penalties: repetition_penalty (Hugging Face's: a
    token of the prompt or the output has its positive logit divided by it, a negative
    one multiplied), frequency_penalty and presence_penalty (OpenAI's: subtracted, times
    the token's count in the output and once if it occurs there); then temperature,
    min_p (tokens less likely than min_p times the most likely are cut), top_k, top_p.
    Greedy rows take the adjusted logits' argmax.

    logprobs N: each generated token's event carries its log-probability and those of
    the N most likely tokens there (0 to MAX_LOGPROBS; None: none). prompt_logprobs N:
    the first event carries the same for every prompt token after the first (computed
    in full: such a prompt takes no prefix-cache hit). Log-probabilities are the
    model's, before any adjustment. skip_special_tokens False keeps special tokens'
    text in the output. structured: the text follows that constraint (the tokens it
    does not allow cannot be sampled, before any other adjustment); the request stops
    when it is complete and admits nothing more.
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        def bad(field: str, rule: str) -> InvalidRequest:
            value = getattr(self, field)
            return InvalidRequest(f"{field}={value!r} {rule}", field=f"sampling.{field}")

        if not _integer(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", "must be a positive integer")
        if not _finite(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", "must be in [0, 100]")
        if not _finite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not _integer(self.top_k) or self.top_k < 0:
            raise bad("top_k", "must be a non-negative integer (0 disables it)")
        if self.seed is not None and not (_integer(self.seed) and 0 <= self.seed < 2**32):
            raise bad("seed", "must be an integer in [0, 2**32)")
        if len(self.stop) > MAX_STOP_STRINGS or any(not s for s in self.stop):
            raise bad("stop", f"must hold at most {MAX_STOP_STRINGS} non-empty strings")
        for field in ("logprobs", "prompt_logprobs"):
            value = getattr(self, field)
            if value is not None and not (_integer(value) and 0 <= value <= MAX_LOGPROBS):
                raise bad(field, f"must be an integer in [0, {MAX_LOGPROBS}]")
        for field in ("presence_penalty", "frequency_penalty"):
            if not _finite(value := getattr(self, field)) or not -2.0 <= value <= 2.0:
                raise bad(field, "must be in [-2, 2]")
        if not _finite(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 100.0:
            raise bad("repetition_penalty", "must be in (0, 100] (1 disables it)")
        if not _finite(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1] (0 disables it)")
        if not _integer(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", f"must be an integer in [0, max_tokens={self.max_tokens}]")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise bad("logit_bias", f"must name at most {MAX_LOGIT_BIAS} tokens")
        for token, bias in self.logit_bias:
            if not _integer(token) or token < 0:
                raise bad("logit_bias", f"has token id {token!r}: ids are non-negative integers")
            if not _finite(bias) or not -100.0 <= bias <= 100.0:
                raise bad(
                    "logit_bias", f"gives token {token} the bias {bias!r}: not in [-100, 100]"
                )
        if len({token for token, _ in self.logit_bias}) < len(self.logit_bias):
            raise bad("logit_bias", "names a token twice")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS or not all(
            _integer(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise bad("stop_token_ids", f"must hold at most {MAX_STOP_TOKEN_IDS} token ids")

    @property
    def adjusts_logits(self) -> bool:
        """Whether a penalty, a bias or min_tokens changes the logits the sampler sees."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
        )


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    adapter: str | None = None  # a registered adapter's name; None is the base model
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)


def check_request(
    request: Request,
    generated: tuple[int, ...],
    *,
    max_seq_len: int,
    vocab_size: int,
    has_tokenizer: bool,
) -> None:
    """InvalidRequest naming the field unless `request` (resumed after `generated` tokens)
    can run on an engine of this context and vocabulary: a prompt that is not empty,
    leaves room to generate and holds tokens of the vocabulary; stop strings only with
    a tokenizer; a resumed request's tokens so far (named as the API's
    `resume.generated_ids`, where they come from) tokens of the vocabulary that leave
    one to generate."""
    prompt = request.prompt_ids
    if not prompt:
        raise InvalidRequest("prompt is empty", field="prompt")
    if len(prompt) >= max_seq_len:
        raise InvalidRequest(
            f"prompt has {len(prompt)} tokens; the context limit is {max_seq_len} "
            f"tokens (max_seq_len), which leaves no room to generate",
            field="prompt",
        )
    bad = next((i for i, t in enumerate(prompt) if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(
            f"prompt_ids[{bad}]={prompt[bad]} is outside the vocabulary [0, {vocab_size})",
            field="prompt",
        )
    if request.sampling.stop and not has_tokenizer:
        raise InvalidRequest(
            "stop strings need a tokenizer; this model has none", field="sampling.stop"
        )
    if request.sampling.structured is not None and not has_tokenizer:
        raise InvalidRequest(
            "structured output needs a tokenizer; this model has none",
            field="sampling.structured",
        )
    for field, ids in (
        ("logit_bias", [token for token, _ in request.sampling.logit_bias]),
        ("stop_token_ids", request.sampling.stop_token_ids),
    ):
        bad = next((t for t in ids if t >= vocab_size), None)
        if bad is not None:
            raise InvalidRequest(
                f"{field} has token id {bad}, outside the vocabulary [0, {vocab_size})",
                field=f"sampling.{field}",
            )
    bad = next((i for i, t in enumerate(generated) if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(
            f"resume.generated_ids[{bad}]={generated[bad]} is outside the vocabulary "
            f"[0, {vocab_size})",
            field="resume.generated_ids",
        )
    max_tokens = request.sampling.max_tokens
    if len(generated) >= max_tokens:
        raise InvalidRequest(
            f"resume.generated_ids has {len(generated)} tokens: sampling.max_tokens="
            f"{max_tokens} leaves none to generate",
            field="resume.generated_ids",
        )
    if len(prompt) + len(generated) >= max_seq_len:
        raise InvalidRequest(
            f"the prompt ({len(prompt)} tokens) and resume.generated_ids "
            f"({len(generated)}) fill the context limit of {max_seq_len} tokens "
            "(max_seq_len)",
            field="resume.generated_ids",
        )


@dataclasses.dataclass(frozen=True)
class SequenceState:
    """A request's whole host state: enough to resume it anywhere with the same tokens.

    The next token is sampled with `seed` at step `len(generated)` (sampling.py), after
    a prefill of prompt + generated, so a resumed request continues exactly as it would
    have (greedy decoding: up to the arithmetic of a prefill against a decode step).
    """

    request_id: str
    prompt_ids: tuple[int, ...]
    generated: tuple[int, ...]
    sampling: SamplingParams
    seed: int
    adapter: str | None
    arrival_time: float


@dataclasses.dataclass(frozen=True)
class Logprobs:
    """The model's log-probabilities at one position (the log-softmax of its logits,
    before temperature and cuts): of the token there, and of the most likely tokens
    (token id, log-probability), most likely first, as many as the request asked."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    """One generated token of one request, or its failure.

    text is the new text this token completes (may be empty while a multi-byte
    character or a possible stop string is pending); finish_reason is set on the
    request's last event: "stop" (EOS or a stop string), "length" (max_tokens or the
    context) or "error": the request failed (`error` says why, naming the field if
    one is at fault) and the event carries no token (token_id -1).
    cached_tokens is set on the event of a prefill (a request's first token, or the
    first after a resume): how many of the prompt's tokens had their keys and values
    taken from the prefix cache instead of being computed; 0 on every other event,
    including the prefill of a request preempted and admitted again (the engine's own
    recomputation, not a prompt served).
    logprobs: this token's (SamplingParams.logprobs), else None. prompt_logprobs: on a
    request's first event, when SamplingParams.prompt_logprobs is set, one entry per
    prompt token after the first (the first has none); else None.
    """

    request_id: str
    token_id: int
    text: str
    finish_reason: str | None = None
    error: RequestError | None = None
    cached_tokens: int = 0
    logprobs: Logprobs | None = None
    prompt_logprobs: tuple[Logprobs, ...] | None = None


@dataclasses.dataclass(frozen=True)
class AdapterInfo:
    """One registered adapter (its record, as staged) and where it is."""

    adapter: Adapter
    state: str  # HOST | LOADING | DEVICE
    slot: int  # the device slot, -1 when state is HOST
    pinned: bool
    running_requests: int  # running requests holding it (it cannot be evicted meanwhile)


@dataclasses.dataclass(frozen=True)
class RunningInfo:
    """One request in the running batch (or in the queue: `EngineStats.queued`)."""

    request_id: str
    adapter: str | None
    rank: int  # the adapter's rank; 0 for the base model
    slot: int  # its decode slot; -1 while paused (merging: another adapter's turn)
    prompt_tokens: int
    generated_tokens: int
    max_tokens: int


@dataclasses.dataclass(frozen=True)
class MergeStats:
    """dLoRA's dynamic batching (engine/merging.py), cumulative since the engine started.

    merged: the adapter merged into the base weights now (None: unmerged). credits: each
    request type's credit ("" is the base model). waits: per type, the longest a runnable
    request of it has gone without a token now (seconds; 0 when all are being served).
    """

    merged: str | None
    alpha: float
    beta: float
    merged_iterations: int
    unmerged_iterations: int
    switches: int
    credits: tuple[tuple[str, float], ...]
    waits: tuple[tuple[str, float], ...]


@dataclasses.dataclass(frozen=True)
class CacheStats:
    """The memory pool and the prefix cache (jlora/engine/memory); counters are cumulative.

    The device pool has `pages_total` pages of `page_bytes` each (one KV block, keys and
    values of every layer): `pages_kv` hold KV blocks (running requests' and cached),
    `pages_kv_cached` of them only cached history (no running request reads them),
    `pages_lora` adapter rank rows, the rest are free. The host pool mirrors it for
    swapped-out KV. `hit_tokens / prompt_tokens` is the prefix cache's hit rate over
    prefilled prompts. `invalid_kv_pages` counts device KV pages whose adapter is not on
    the device (FastLibra's "invalid KV"; the fastlibra policy keeps it at 0).
    """

    policy: str
    page_bytes: int
    pages_total: int
    pages_kv: int
    pages_kv_cached: int
    pages_lora: int
    host_bytes_used: int
    host_bytes_capacity: int
    prompt_tokens: int
    hit_tokens: int
    swaps_out: int  # KV blocks moved to the host pool (adapters stay in the host store)
    swaps_in: int  # moved back to the device
    swap_out_bytes: int
    swap_in_bytes: int
    invalid_kv_pages: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """A snapshot between two steps; counters (adapter_loads, adapter_evictions) are
    cumulative since the engine started."""

    running: tuple[RunningInfo, ...]
    waiting: int  # queued, not yet admitted
    max_slots: int
    max_seq_len: int
    kv_blocks_total: int
    kv_blocks_free: int  # pages neither requests nor adapters hold (free, or cached KV)
    kv_block_size: int
    adapter_slots_total: int
    adapter_slots_free: int
    adapter_slots_loading: int
    adapter_loads: int
    adapter_evictions: int
    host_store_bytes_used: int = 0
    host_store_bytes_capacity: int = 0
    device_bytes_in_use: int = -1  # -1: unknown
    device_bytes_limit: int = -1
    merging: MergeStats | None = None  # None: merging is off (merge="never")
    queued: tuple[RunningInfo, ...] = ()  # the `waiting` requests, in order (slot -1)
    kv_block_bytes: int = 0  # one KV block across layers, keys and values (0: unknown)
    cache: CacheStats | None = None  # the memory pool and prefix cache
    preemptions: int = 0  # running requests sent back to the queue (the KV pool ran out)
    prefill_chunks: int = 0  # prefills cut short by the step's prefill_token_budget
    adapter_wait_s: float = 0.0  # seconds queued requests spent waiting for their adapter
