"""The engine interface the CLI, the server and the tests talk to.

An engine owns a queue of requests and advances all of them by one iteration per
`step()`: new requests are prefilled and join the running batch, the running batch
decodes one token, finished requests leave. Each step returns the tokens it
produced as `TokenEvent`s. A mock engine (for server tests) implements the same class.
"""

from __future__ import annotations

import abc
import dataclasses
import math
import time

MAX_STOP_STRINGS = 16


class InvalidRequest(ValueError):
    """A request cannot be served as asked; the message names the field."""


class UnknownAdapter(InvalidRequest):
    """A request names an adapter that is not registered (NOT_FOUND to a client)."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature 0 is greedy decoding; top_k 0 and top_p 1 disable those cuts;
    seed None draws a fresh seed for the request. A request stops at the first of:
    an end-of-sequence token (unless ignore_eos), a stop string (excluded from the
    text), max_tokens generated, or the engine's max_seq_len.
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens={self.max_tokens!r} must be a positive integer")
        if not _finite(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            raise InvalidRequest(f"temperature={self.temperature!r} must be in [0, 100]")
        if not _finite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p={self.top_p!r} must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequest(
                f"top_k={self.top_k!r} must be a non-negative integer (0 disables it)"
            )
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**32):
            raise InvalidRequest(f"seed={self.seed!r} must be an integer in [0, 2**32)")
        if len(self.stop) > MAX_STOP_STRINGS or any(not s for s in self.stop):
            raise InvalidRequest(
                f"stop={self.stop!r} must hold at most {MAX_STOP_STRINGS} non-empty strings"
            )


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


@dataclasses.dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    adapter: str | None = None  # a registered adapter's name; None is the base model
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    """One generated token of one request.

    text is the new text this token completes (may be empty while a multi-byte
    character or a possible stop string is pending); finish_reason is set on the
    request's last event: "stop" (EOS or a stop string), "length" (max_tokens or
    the context).
    """

    request_id: str
    token_id: int
    text: str
    finish_reason: str | None = None


# AdapterInfo.state
HOST, LOADING, DEVICE = "host", "loading", "device"


@dataclasses.dataclass(frozen=True)
class AdapterInfo:
    """One registered adapter and where it is."""

    name: str
    path: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]  # canonical order
    sha256: str  # of adapter_model.safetensors ("" if unknown)
    size_bytes: int  # of adapter_model.safetensors
    state: str  # HOST | LOADING | DEVICE
    slot: int  # the device slot, -1 when state is HOST
    pinned: bool
    running_requests: int  # running requests holding it (it cannot be evicted meanwhile)


@dataclasses.dataclass(frozen=True)
class RunningInfo:
    """One request in the running batch."""

    request_id: str
    adapter: str | None
    rank: int  # the adapter's rank; 0 for the base model
    slot: int  # its decode slot
    prompt_tokens: int
    generated_tokens: int


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """A snapshot between two steps; counters (adapter_loads, adapter_evictions) are
    cumulative since the engine started."""

    running: tuple[RunningInfo, ...]
    waiting: int  # queued, not yet admitted
    max_slots: int
    max_seq_len: int
    kv_blocks_total: int
    kv_blocks_free: int
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


class Engine(abc.ABC):
    @abc.abstractmethod
    def add_request(self, request: Request) -> None:
        """Queue a request; raise InvalidRequest (and change nothing) if it cannot run."""

    @abc.abstractmethod
    def abort(self, request_id: str) -> bool:
        """Drop a queued or running request, freeing its slot and blocks."""

    @abc.abstractmethod
    def warmup(
        self, prompt_lengths: list[int] | None = None, max_length: int | None = None
    ) -> None:
        """Compile every step shape (or those these prompts, growing to max_length, need)."""

    @abc.abstractmethod
    def step(self) -> list[TokenEvent]:
        """Run one iteration (admit + prefill, then decode) and return its tokens."""

    def close(self) -> None:  # noqa: B027 (optional: engines without resources keep it)
        """Release what the engine holds outside Python (shared memory, threads)."""

    @property
    @abc.abstractmethod
    def has_unfinished(self) -> bool: ...

    @property
    @abc.abstractmethod
    def max_slots(self) -> int: ...

    @property
    @abc.abstractmethod
    def max_seq_len(self) -> int: ...
