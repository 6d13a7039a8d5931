"""Tokenizer and chat template, built offline from GGUF metadata or a model directory.

A GGUF file carries its vocabulary (`tokenizer.ggml.tokens`), token types, special
ids and a Jinja chat template; we build a `tokenizers` BPE from them, of one of two
kinds (`tokenizer.ggml.model`):

- 'gpt2': byte-level BPE (SmolLM, Llama-3, Qwen), with its merges in the file.
- 'llama': SentencePiece BPE (Llama-2, Mistral), as llama.cpp and Hugging Face run
  it: spaces become '▁' and one is prepended, characters outside the vocabulary fall
  back to the byte pieces '<0x00>'..'<0xFF>', and the merges, usually absent from
  the file, are derived from the pieces' scores.

A model directory (Hugging Face, or one written by `jlora convert`) carries
`tokenizer.json` and `tokenizer_config.json`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _BPE

# GGUF token types (llama.cpp `llama_token_type`).
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4
# SentencePiece's stand-in for a space.
_SPACE = "\u2581"


class TokenizerError(ValueError):
    """The tokenizer metadata is missing or unsupported; the message names the field."""


def _required(fields: dict[str, Any], key: str) -> Any:
    if key not in fields:
        raise TokenizerError(f"GGUF metadata field {key} is missing")
    return fields[key]


def _merges(fields: dict[str, Any]) -> list[tuple[str, str]]:
    """`tokenizer.ggml.merges`: 'left right' strings, best first."""
    return [tuple(m.split(" ", 1)) for m in fields.get("tokenizer.ggml.merges", [])]


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer llama.cpp uses for `tokenizer.ggml.pre`.

    SmolLM ('smollm') splits every digit on its own before the GPT-2 byte-level
    regex, as the model was trained; other GPT-2 style vocabularies use the regex alone.
    """
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


def _byte_level_bpe(fields: dict[str, Any], tokens: list[str]) -> _BPE:
    """'gpt2': bytes mapped to printable characters, split by a regex, then merged."""
    backend = _BPE(
        models.BPE(
            vocab={t: i for i, t in enumerate(tokens)}, merges=_merges(fields), fuse_unk=False
        )
    )
    backend.pre_tokenizer = _pre_tokenizer(fields.get("tokenizer.ggml.pre", "gpt2"))
    backend.decoder = decoders.ByteLevel()
    return backend


def merges_from_scores(
    tokens: list[str], scores: list[float], types: list[int] | None
) -> list[tuple[str, str]]:
    """BPE merges, best first, that tokenize as SentencePiece BPE does with these scores.

    Semantics: SentencePiece (and llama.cpp) repeatedly joins the adjacent pair of
    symbols whose concatenation is the highest-scoring normal piece, the leftmost
    pair on a tie. A `tokenizers` BPE applies its best-ranked merge instead, so each
    way to split a normal piece into two normal pieces becomes a merge, ranked by the
    whole piece's score (ties: lower piece id, then shorter left half). Ranks cannot
    express the leftmost rule between two different pieces of equal score; trained
    SentencePiece BPE vocabularies give every piece its own score.
    types: `tokenizer.ggml.token_type`, or None when all pieces are normal. Control,
    byte and unknown pieces are never the result of a merge.
    """
    normal = {
        piece: piece_id
        for piece_id, piece in enumerate(tokens)
        if types is None or types[piece_id] == _NORMAL
    }
    ranked = [
        (-scores[piece_id], piece_id, cut, piece[:cut], piece[cut:])
        for piece, piece_id in normal.items()
        for cut in range(1, len(piece))
        if piece[:cut] in normal and piece[cut:] in normal
    ]
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _sentencepiece_bpe(fields: dict[str, Any], tokens: list[str]) -> _BPE:
    """'llama': '▁' for spaces, byte fallback, merges from the scores unless given."""
    merges = _merges(fields) or merges_from_scores(
        tokens,
        _required(fields, "tokenizer.ggml.scores"),
        fields.get("tokenizer.ggml.token_type"),
    )
    backend = _BPE(
        models.BPE(
            vocab={t: i for i, t in enumerate(tokens)},
            merges=merges,
            unk_token=tokens[fields["tokenizer.ggml.unknown_token_id"]],
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    add_space_prefix = bool(fields["tokenizer.ggml.add_space_prefix"])
    prepend = [normalizers.Prepend(_SPACE)] if add_space_prefix else []
    backend.normalizer = normalizers.Sequence([*prepend, normalizers.Replace(" ", _SPACE)])
    strip = [decoders.Strip(" ", left=1, right=0)] if add_space_prefix else []
    backend.decoder = decoders.Sequence(
        [decoders.ByteFallback(), decoders.Fuse(), decoders.Replace(_SPACE, " "), *strip]
    )
    return backend


_BUILDERS = {"gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe}
# tokenizer.ggml.model -> llama.cpp's values for the metadata a file leaves out.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "gpt2": {},
    "llama": {
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_space_prefix": True,
    },
}


class Tokenizer:
    def __init__(
        self,
        backend: _BPE,
        *,
        bos_id: int | None,
        eos_ids: list[int],
        add_bos: bool,
        chat_template: str | None,
    ) -> None:
        self.backend = backend
        self.bos_id = bos_id
        self.eos_ids = eos_ids
        self.add_bos = add_bos
        self.chat_template = chat_template

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    # -- construction ---------------------------------------------------------

    @classmethod
    def from_gguf_fields(cls, fields: dict[str, Any]) -> Tokenizer:
        """fields: GGUF metadata key -> decoded value (see `jlora.model.gguf`)."""
        kind = fields.get("tokenizer.ggml.model")
        if kind not in _BUILDERS:
            raise TokenizerError(
                f"tokenizer.ggml.model={kind!r} is not supported "
                "(only 'gpt2' byte-level BPE and 'llama' SentencePiece BPE)"
            )
        fields = {**_DEFAULTS[kind], **fields}
        tokens: list[str] = _required(fields, "tokenizer.ggml.tokens")
        backend = _BUILDERS[kind](fields, tokens)
        types = fields.get("tokenizer.ggml.token_type", [])
        backend.add_special_tokens(
            [
                AddedToken(tokens[i], special=True, normalized=False)
                for i, t in enumerate(types)
                if t == _CONTROL
            ]
        )
        backend.add_tokens(
            [
                AddedToken(tokens[i], normalized=False)
                for i, t in enumerate(types)
                if t == _USER_DEFINED
            ]
        )
        eos = fields.get("tokenizer.ggml.eos_token_id")
        eot = fields.get("tokenizer.ggml.eot_token_id")
        return cls(
            backend,
            bos_id=fields.get("tokenizer.ggml.bos_token_id"),
            eos_ids=sorted({i for i in (eos, eot) if i is not None}),
            add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", False)),
            chat_template=fields.get("tokenizer.chat_template"),
        )

    @classmethod
    def from_dir(cls, path: Path) -> Tokenizer:
        """From `tokenizer.json` + `tokenizer_config.json` (HF or `jlora convert` layout)."""
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise TokenizerError(f"{tok_file} not found")
        backend = _BPE.from_file(str(tok_file))
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}

        def token_id(key: str) -> int | None:
            value = config.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            return backend.token_to_id(value) if isinstance(value, str) else None

        eos = token_id("eos_token")
        eos_ids = config.get("eos_token_ids") or ([] if eos is None else [eos])
        bos = config.get("bos_token_id", token_id("bos_token"))
        return cls(
            backend,
            bos_id=bos,
            eos_ids=list(eos_ids),
            add_bos=bool(config.get("add_bos_token", False)),
            chat_template=config.get("chat_template"),
        )

    def save(self, path: Path) -> None:
        """Write the `from_dir` layout."""
        self.backend.save(str(path / "tokenizer.json"))
        config = {
            "bos_token_id": self.bos_id,
            "eos_token_ids": self.eos_ids,
            "add_bos_token": self.add_bos,
            "chat_template": self.chat_template,
        }
        (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))

    # -- use ------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        # encode_batch gives the same ids and releases the GIL while it works; encode
        # holds it throughout (1.5 s for a 3 MB prompt, and no other thread runs meanwhile).
        ids = self.backend.encode_batch([text], add_special_tokens=False)[0].ids
        if self.add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        """Render a conversation, ending with the assistant's generation prompt."""
        if not self.chat_template:
            raise TokenizerError("this model has no chat template (tokenizer.chat_template)")
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message: str) -> None:
            raise TokenizerError(f"chat template: {message}")

        env.globals["raise_exception"] = raise_exception

        def special(token_id: int | None) -> str:
            return "" if token_id is None else self.backend.id_to_token(token_id) or ""

        return env.from_string(self.chat_template).render(
            messages=messages,
            add_generation_prompt=True,
            bos_token=special(self.bos_id),
            eos_token=special(self.eos_ids[0] if self.eos_ids else None),
        )
