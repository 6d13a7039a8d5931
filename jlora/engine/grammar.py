"""Structured output on the host: a request's grammar and the tokens it allows next.

llguidance (a Rust library with a numpy bitmask API, no torch) compiles each
constraint (`StructuredOutput`: a JSON schema, any JSON object, a regex, a choice of
strings, a Lark grammar) once per tokenizer and caches it; each request matches its
own copy of it. Before each of a constrained row's steps, `mask` gives the tokens the
grammar allows next as a bitmask (i32[ceil(V / 32)], bit t % 32 of word t // 32 for
token t; sampling.py applies it inside the compiled step), and `Grammars.masks` those of
a batch's rows at once, on llguidance's threads; after the step, `consume`
advances the grammar by the token sampled. A grammar that is complete and admits
nothing more has `stopped`; EOS is allowed wherever it is complete.
"""

from __future__ import annotations

import json
import re

import llguidance
import llguidance.numpy
import numpy as np

from jlora.contract.errors import InvalidRequest, RequestError
from jlora.engine.api import StructuredOutput

FIELD = "sampling.structured"


class Grammars:
    """The compiled constraints of one tokenizer (a `tokenizers` JSON) over `vocab_size`
    token ids (the model's, which may exceed the tokenizer's), most recent `capacity`."""

    def __init__(
        self, tokenizer_json: str, vocab_size: int, eos_ids: list[int], capacity: int = 256
    ) -> None:
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer_json, n_vocab=vocab_size, eos_token=eos_ids or None
        )
        self.words = -(-vocab_size // 32)
        self.capacity = capacity
        self._executor = llguidance.LLExecutor()
        self._compiled: dict[StructuredOutput, llguidance.LLMatcher] = {}

    @classmethod
    def of(cls, tokenizer: object, vocab_size: int, eos_ids: list[int]) -> Grammars:
        """The grammars of a jlora Tokenizer (its `tokenizers` backend); InvalidRequest
        naming the field where there is none."""
        backend = getattr(tokenizer, "backend", None)
        if backend is None:
            raise InvalidRequest(
                "structured output needs the model's Hugging Face tokenizer", field=FIELD
            )
        return cls(backend.to_str(), vocab_size, eos_ids)

    def matcher(self, constraint: StructuredOutput) -> Matcher:
        """A fresh matcher of `constraint`; InvalidRequest naming it if it does not
        compile."""
        template = self._compiled.pop(constraint, None)
        if template is None:
            template = llguidance.LLMatcher(self.tokenizer, _grammar(constraint))
            if template.is_error():
                raise InvalidRequest(
                    f"structured output {constraint.kind}: {template.get_error()}", field=FIELD
                )
        self._compiled[constraint] = template  # most recent last
        while len(self._compiled) > self.capacity:
            self._compiled.pop(next(iter(self._compiled)))
        return Matcher(template.deep_copy(), self.words)

    def masks(self, matchers: list[Matcher]) -> np.ndarray:
        """i32[len(matchers), words]: each one's `mask`, computed in parallel."""
        out = np.zeros((len(matchers), self.words), np.int32)
        pairs = [(matcher._matcher, i) for i, matcher in enumerate(matchers)]
        llguidance.numpy.fill_next_token_bitmask_par(self._executor, pairs, out)
        return out


class Matcher:
    """One request's place in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher, words: int) -> None:
        self._matcher = matcher
        self._mask = np.zeros((1, words), np.int32)

    def mask(self) -> np.ndarray:
        """i32[words]: the tokens allowed next (a copy)."""
        llguidance.numpy.fill_next_token_bitmask(self._matcher, self._mask, 0)
        return self._mask[0].copy()

    def consume(self, token: int) -> None:
        """Advance by `token`; RequestError if the grammar did not allow it."""
        if not self._matcher.consume_token(token):
            raise RequestError(
                f"token {token} breaks the request's grammar: {self._matcher.get_error()}",
                reason="GRAMMAR_VIOLATED",
            )

    @property
    def stopped(self) -> bool:
        """Complete, and nothing more may follow."""
        return self._matcher.is_stopped()


def _grammar(constraint: StructuredOutput) -> str:
    spec = constraint.spec
    if constraint.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps({"type": "object"}))
    if constraint.kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(spec)
    if constraint.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if constraint.kind == "choice":
        return llguidance.LLMatcher.grammar_from_regex("|".join(map(re.escape, constraint.choices)))
    return llguidance.LLMatcher.grammar_from_lark(spec)
