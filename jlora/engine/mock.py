"""A mock engine: the real engine's bookkeeping around a fake model, for server tests.

Each generated token is a pure function of (previous token, adapter, step), see
`mock_next_token`, so a test knows the exact stream every request must receive,
whatever else shares the batch, and `mock_completion` computes it. No jax is imported;
a step sleeps `step_latency` seconds in place of the device.

A request's life mirrors `LLMEngine`:

1. `add_request` validates (duplicate id, unknown adapter, empty prompt, prompt not
   shorter than max_seq_len, ids outside the vocabulary) and queues; InvalidRequest
   changes nothing.
2. `step()` admits queued requests first-come first-served while a decode slot and the
   KV blocks for the whole sequence (prompt + max_tokens, capped at max_seq_len) are
   free and the request's adapter has a device adapter slot. Loading is instant (it
   counts as a load); a slot is taken from the least recently used adapter that no
   running request holds and nobody pinned; a request whose adapter finds no slot
   waits, and later requests may go first.
3. An admitted request's prefill emits its first token; then every running request
   decodes one token, so a request admitted in a step gets two tokens in it, as in
   `LLMEngine`.
4. A request finishes at an `eos_id` token (unless ignore_eos), a stop string (the real
   `Detokenizer` over `MockTokenizer`), max_tokens or max_seq_len, and gives back its
   slot, its blocks and its hold on the adapter at once; `abort` does the same.

Everything runs on the caller's thread; like `LLMEngine`, the engine is not thread-safe.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import math
import time
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import cast

from jlora.adapters.peft import AdapterError, read_lora_spec
from jlora.adapters.store import NAME_PATTERN
from jlora.engine.api import (
    DEVICE,
    HOST,
    AdapterInfo,
    Engine,
    EngineStats,
    InvalidRequest,
    Request,
    RunningInfo,
    TokenEvent,
    UnknownAdapter,
)
from jlora.engine.detokenizer import Detokenizer
from jlora.tokenizer import Tokenizer


def mock_next_token(previous: int, adapter: str | None, step: int, vocab_size: int) -> int:
    """The token after `previous` when `step` tokens have been generated already."""
    salt = 0 if adapter is None else zlib.crc32(adapter.encode())
    return (previous * 7919 + salt + 104729 * (step + 1)) % vocab_size


def mock_completion(
    prompt_ids: list[int], adapter: str | None, num_tokens: int, vocab_size: int
) -> list[int]:
    """The first `num_tokens` tokens a MockEngine generates for this prompt and adapter."""
    tokens: list[int] = []
    previous = prompt_ids[-1]
    for step in range(num_tokens):
        previous = mock_next_token(previous, adapter, step, vocab_size)
        tokens.append(previous)
    return tokens


class MockTokenizer:
    """Text <-> ids for the mock: a prompt's UTF-8 bytes are its ids; token t reads ' t<t>'.

    (Not inverses of each other; the mock only needs both directions to be deterministic.)
    """

    def __init__(self) -> None:
        self.eos_ids: list[int] = []

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return "".join(f" t{token}" for token in ids)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        turns = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return turns + "<assistant>"


@dataclasses.dataclass
class _Adapter:
    name: str
    path: str
    rank: int
    alpha: float
    targets: tuple[str, ...]
    sha256: str  # of adapter_model.safetensors, "" if the directory has none
    size_bytes: int


@dataclasses.dataclass
class _Sequence:
    request: Request
    limit: int  # prompt + generated may grow to this many tokens
    detokenizer: Detokenizer
    blocks: int = 0
    slot: int = -1
    generated: list[int] = dataclasses.field(default_factory=list)

    @property
    def length(self) -> int:
        return len(self.request.prompt_ids) + len(self.generated)


class MockEngine(Engine):
    """See the module docstring. `adapters` maps names to ranks (registered up front)."""

    def __init__(
        self,
        *,
        max_slots: int = 4,
        max_seq_len: int = 128,
        vocab_size: int = 1000,
        step_latency: float = 0.0,
        adapters: Mapping[str, int] | None = None,
        max_loras: int = 2,
        block_size: int = 16,
        num_blocks: int | None = None,
        eos_id: int | None = None,
    ) -> None:
        for field, value in (
            ("max_slots", max_slots),
            ("max_seq_len", max_seq_len),
            ("vocab_size", vocab_size),
            ("max_loras", max_loras),
            ("block_size", block_size),
        ):
            if value < 1:
                raise ValueError(f"MockEngine {field}={value} must be positive")
        self._max_slots = max_slots
        self._max_seq_len = max_seq_len
        self.vocab_size = vocab_size
        self.step_latency = step_latency
        self.block_size = block_size
        self.num_blocks = num_blocks or max_slots * math.ceil(max_seq_len / block_size)
        self.eos_id = eos_id
        self.max_loras = max_loras
        self.tokenizer = MockTokenizer()
        self.steps = 0  # step() calls that did work
        self.free_blocks = self.num_blocks
        self._waiting: collections.deque[_Sequence] = collections.deque()
        self._slots: list[_Sequence | None] = [None] * max_slots
        self._ids: set[str] = set()
        self._adapters: dict[str, _Adapter] = {}
        self._resident: collections.OrderedDict[str, int] = collections.OrderedDict()  # LRU
        self._pinned: set[str] = set()
        self._holds: collections.Counter[str] = collections.Counter()
        self.adapter_loads = 0
        self.adapter_evictions = 0
        for name, rank in (adapters or {}).items():
            self._adapters[name] = _Adapter(
                name, "", rank, float(rank), ("q_proj", "v_proj"), "", 0
            )

    # -- Engine interface ------------------------------------------------------------

    @property
    def max_slots(self) -> int:
        return self._max_slots

    @property
    def max_seq_len(self) -> int:
        return self._max_seq_len

    @property
    def has_unfinished(self) -> bool:
        return bool(self._waiting) or self.num_running > 0

    @property
    def num_running(self) -> int:
        return sum(seq is not None for seq in self._slots)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def warmup(
        self, prompt_lengths: list[int] | None = None, max_length: int | None = None
    ) -> None:
        """Nothing to compile."""

    def add_request(self, request: Request) -> None:
        prompt = request.prompt_ids
        if request.request_id in self._ids:
            raise InvalidRequest(f"request_id={request.request_id!r} is already in use")
        if request.adapter is not None and request.adapter not in self._adapters:
            raise UnknownAdapter(f"adapter={request.adapter!r} is not registered")
        if not prompt:
            raise InvalidRequest("prompt is empty")
        if len(prompt) >= self.max_seq_len:
            raise InvalidRequest(
                f"prompt has {len(prompt)} tokens; the context limit is {self.max_seq_len} "
                f"tokens (max_seq_len), which leaves no room to generate"
            )
        bad = next((i for i, t in enumerate(prompt) if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(
                f"prompt_ids[{bad}]={prompt[bad]} is outside the vocabulary [0, {self.vocab_size})"
            )
        limit = min(len(prompt) + request.sampling.max_tokens, self.max_seq_len)
        detokenizer = Detokenizer(cast(Tokenizer, self.tokenizer), request.sampling.stop)
        self._waiting.append(_Sequence(request, limit, detokenizer))
        self._ids.add(request.request_id)

    def abort(self, request_id: str) -> bool:
        for queued in self._waiting:
            if queued.request.request_id == request_id:
                self._waiting.remove(queued)
                self._ids.discard(request_id)
                return True
        for running in self._slots:
            if running is not None and running.request.request_id == request_id:
                self._release(running)
                return True
        return False

    def step(self) -> list[TokenEvent]:
        events: list[TokenEvent] = []
        if not self.has_unfinished:
            return events
        self.steps += 1
        if self.step_latency:
            time.sleep(self.step_latency)
        for seq in list(self._waiting):
            if None not in self._slots:
                break
            blocks = math.ceil(seq.limit / self.block_size)
            if blocks > self.free_blocks:
                break
            adapter = seq.request.adapter
            if adapter is not None and not self._make_resident(adapter):
                continue  # every adapter slot is held: wait, let later requests go
            self._waiting.remove(seq)
            if adapter is not None:
                self._holds[adapter] += 1
            seq.blocks, self.free_blocks = blocks, self.free_blocks - blocks
            seq.slot = self._slots.index(None)
            self._slots[seq.slot] = seq
            self._generate(seq, events)  # the prefill's token
        for seq in [s for s in self._slots if s is not None]:
            self._generate(seq, events)
        return events

    # -- adapters (jlora.server.engine_info.AdapterControl) ----------------------------

    def register_adapter(self, name: str, path: str | Path) -> AdapterInfo:
        if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
            raise AdapterError(
                f"adapter name={name!r} must be 1-128 characters of letters, digits and "
                "._:- starting with a letter or digit"
            )
        if name in self._adapters:
            raise AdapterError(f"adapter name={name!r} is already registered")
        spec = read_lora_spec(path)
        weights = Path(path) / "adapter_model.safetensors"
        data = weights.read_bytes() if weights.is_file() else b""
        digest = hashlib.sha256(data).hexdigest() if data else ""
        self._adapters[name] = _Adapter(
            name, str(path), spec.rank, spec.alpha, spec.targets, digest, len(data)
        )
        return self._info(name)

    def unregister_adapter(self, name: str) -> None:
        self._check_registered(name)
        users = sum(s.request.adapter == name for s in self._waiting)
        users += sum(s is not None and s.request.adapter == name for s in self._slots)
        if users:
            raise AdapterError(f"adapter {name!r} is named by {users} queued or running requests")
        self._resident.pop(name, None)
        self._pinned.discard(name)
        del self._adapters[name]

    def load_adapter(self, name: str, *, pin: bool = False) -> None:
        self._check_registered(name)
        if not self._make_resident(name):
            raise AdapterError(
                f"adapter {name!r}: all max_loras={self.max_loras} device slots are held by "
                "running requests or pinned"
            )
        if pin:
            self._pinned.add(name)

    def unload_adapter(self, name: str) -> None:
        self._check_registered(name)
        if self._holds[name]:
            raise AdapterError(f"adapter {name!r} is used by {self._holds[name]} running requests")
        self._pinned.discard(name)
        self._resident.pop(name, None)

    def adapter_infos(self) -> list[AdapterInfo]:
        return [self._info(name) for name in self._adapters]

    # -- introspection (jlora.server.engine_info.Introspectable) -----------------------

    def stats(self) -> EngineStats:
        running = tuple(
            RunningInfo(
                request_id=seq.request.request_id,
                adapter=seq.request.adapter,
                rank=self._adapters[seq.request.adapter].rank if seq.request.adapter else 0,
                slot=seq.slot,
                prompt_tokens=len(seq.request.prompt_ids),
                generated_tokens=len(seq.generated),
            )
            for seq in self._slots
            if seq is not None
        )
        return EngineStats(
            running=running,
            waiting=len(self._waiting),
            max_slots=self.max_slots,
            max_seq_len=self.max_seq_len,
            kv_blocks_total=self.num_blocks,
            kv_blocks_free=self.free_blocks,
            kv_block_size=self.block_size,
            adapter_slots_total=self.max_loras,
            adapter_slots_free=self.max_loras - len(self._resident),
            adapter_slots_loading=0,
            adapter_loads=self.adapter_loads,
            adapter_evictions=self.adapter_evictions,
        )

    # -- internals -------------------------------------------------------------------

    def _generate(self, seq: _Sequence, events: list[TokenEvent]) -> None:
        previous = seq.generated[-1] if seq.generated else seq.request.prompt_ids[-1]
        token = mock_next_token(previous, seq.request.adapter, len(seq.generated), self.vocab_size)
        seq.generated.append(token)
        sampling = seq.request.sampling
        text, hit_stop = seq.detokenizer.add(token)
        finish = None
        if hit_stop or (token == self.eos_id and not sampling.ignore_eos):
            finish = "stop"
        elif seq.length >= seq.limit:
            finish = "length"
        if finish is not None and not hit_stop:
            text += seq.detokenizer.flush()
        events.append(TokenEvent(seq.request.request_id, token, text, finish))
        if finish is not None:
            self._release(seq)

    def _release(self, seq: _Sequence) -> None:
        self.free_blocks += seq.blocks
        seq.blocks = 0
        self._slots[seq.slot] = None
        adapter = seq.request.adapter
        if adapter is not None:
            self._holds[adapter] -= 1
        self._ids.discard(seq.request.request_id)

    def _make_resident(self, name: str) -> bool:
        """Give `name` a device adapter slot (evicting if need be); False if none can be had."""
        if name in self._resident:
            self._resident.move_to_end(name)
            return True
        if len(self._resident) >= self.max_loras:
            victim = next(
                (a for a in self._resident if not self._holds[a] and a not in self._pinned),
                None,
            )
            if victim is None:
                return False
            del self._resident[victim]
            self.adapter_evictions += 1
        free = sorted(set(range(self.max_loras)) - set(self._resident.values()))
        self._resident[name] = free[0]
        self.adapter_loads += 1
        return True

    def _check_registered(self, name: str) -> None:
        if name not in self._adapters:
            raise AdapterError(f"adapter name={name!r} is not registered")

    def _info(self, name: str) -> AdapterInfo:
        adapter = self._adapters[name]
        slot = self._resident.get(name, -1)
        return AdapterInfo(
            name=name,
            path=adapter.path,
            rank=adapter.rank,
            alpha=adapter.alpha,
            target_modules=adapter.targets,
            sha256=adapter.sha256,
            size_bytes=adapter.size_bytes,
            state=DEVICE if slot >= 0 else HOST,
            slot=slot,
            pinned=name in self._pinned,
            running_requests=self._holds[name],
        )
