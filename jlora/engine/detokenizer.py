"""Incremental detokenization with stop strings, on the host.

Each new token re-decodes the request's generated ids and releases only text that
is final: not ending in an incomplete UTF-8 sequence (decoded as U+FFFD), and not
possibly the beginning of a stop string. When a stop string appears, the text is
cut before it and the request finishes.
"""

from __future__ import annotations

from jlora.tokenizer import Tokenizer


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...]) -> None:
        self._tokenizer = tokenizer
        self._stop = stop
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self._ids: list[int] = []
        self._emitted = 0  # characters of the decoded text already released
        self.text = ""

    def add(self, token_id: int) -> tuple[str, bool]:
        """Returns (newly final text, whether a stop string was hit)."""
        self._ids.append(token_id)
        full = self._tokenizer.decode(self._ids)
        search_from = max(0, self._emitted - self._holdback)
        cuts = [i for i in (full.find(s, search_from) for s in self._stop) if i >= 0]
        if cuts:
            return self._release(full, min(cuts)), True
        end = len(full) - self._holdback
        if full.endswith("\ufffd"):
            end = min(end, len(full.rstrip("\ufffd")))
        return self._release(full, end), False

    def flush(self) -> str:
        """At the end of the request: everything not yet released (no stop string was hit)."""
        return self._release(self._tokenizer.decode(self._ids), None)

    def _release(self, full: str, end: int | None) -> str:
        end = len(full) if end is None else max(end, self._emitted)
        delta = full[self._emitted:end]
        self._emitted = end
        self.text = full[:end]
        return delta
