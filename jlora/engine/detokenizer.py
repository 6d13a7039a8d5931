"""Incremental detokenization with stop strings, on the host.

Each new token decodes only a short window: the tokens since the last released
text plus the few before it (their context matters to some tokenizers), so the
cost per token stays constant however long the output grows. Text is released only
once it is final: not ending in an incomplete UTF-8 sequence (decoded as U+FFFD),
and not possibly the beginning of a stop string. When a stop string appears, the
text is cut before it (after it, with `include_stop`) and the request finishes. As
vLLM, no stop string is looked for until more than `min_tokens` tokens are in, and
then only one that ends in the text after them.
"""

from __future__ import annotations

from typing import Protocol


class Decoder(Protocol):
    """What a detokenizer needs of a tokenizer (`jlora.tokenizer.Tokenizer` is one)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class Detokenizer:
    def __init__(
        self,
        tokenizer: Decoder,
        stop: tuple[str, ...],
        *,
        include_stop: bool = False,
        min_tokens: int = 0,
        skip_special: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._stop = stop
        self._include_stop = include_stop
        self._min_tokens = min_tokens
        self._skip_special = skip_special
        self._floor = 0  # a stop string must end past this character
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self._ids: list[int] = []
        self._prefix = 0  # first id of the decoding window (context only)
        self._read = 0  # ids[:read] are decoded into self._decoded
        self._decoded = ""
        self._emitted = 0  # characters of self._decoded already released
        self.text = ""  # the released text

    def add(self, token_id: int) -> tuple[str, bool]:
        """Returns (newly final text, whether a stop string was hit)."""
        self._ids.append(token_id)
        tail = self._tail()
        if not tail.endswith("\ufffd"):
            self._decoded += tail
            self._prefix, self._read = self._read, len(self._ids)
        full = self._decoded
        if len(self._ids) <= self._min_tokens:
            self._floor = len(full)
            return self._release(len(full) - self._holdback), False
        search_from = max(0, self._emitted - self._holdback)
        hits = [(i, i + len(s)) for s in self._stop if (i := self._find(s, search_from)) >= 0]
        if hits:
            start, end = min(hits)
            return self._release(end if self._include_stop else start), True
        return self._release(len(full) - self._holdback), False

    def _find(self, stop: str, start: int) -> int:
        """The first `stop` in the text from `start` that ends past the floor; -1: none."""
        i = self._decoded.find(stop, start)
        while i >= 0 and i + len(stop) <= self._floor:
            i = self._decoded.find(stop, i + 1)
        return i

    def flush(self) -> str:
        """At the end of the request: everything not yet released (no stop string was hit)."""
        self._decoded += self._tail()
        self._read = len(self._ids)
        return self._release(len(self._decoded))

    def _tail(self) -> str:
        """The text of ids[read:], decoded with ids[prefix:read] as context."""
        skip = self._skip_special
        context = self._tokenizer.decode(self._ids[self._prefix : self._read], skip)
        return self._tokenizer.decode(self._ids[self._prefix :], skip)[len(context) :]

    def _release(self, end: int) -> str:
        end = max(end, self._emitted)
        delta = self._decoded[self._emitted : end]
        self._emitted = end
        self.text = self._decoded[:end]
        return delta
