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
`tokenizer.json` and `tokenizer_config.json`; its chat template may be a file of its own
(`chat_template.jinja`) or a list of named templates (the "default" one is used), its
BOS comes from `tokenizer.json`'s post-processor where that adds it (Llama 3), and its
end-of-sequence ids include `generation_config.json`'s (Llama 3 Instruct also stops on
`<|eot_id|>`).

Chat templates render as Hugging Face renders them: a sandboxed Jinja environment with
`loopcontrols`, `raise_exception`, `strftime_now` and a `tojson` that keeps non-ASCII
text and takes `indent`.
"""

from __future__ import annotations

import datetime
import functools
import json
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta
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


# tokenizer.ggml.pre values whose splitting is the GPT-2 regex (llama.cpp's "default").
_GPT2_PRE = ("gpt2", "default")


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer llama.cpp uses for `tokenizer.ggml.pre`.

    SmolLM ('smollm') splits every digit on its own before the GPT-2 byte-level
    regex, as the model was trained; 'gpt2' and 'default' vocabularies use the regex
    alone. Others (Llama 3's 'llama-bpe', Qwen2's 'qwen2', ...) split by regexes of their
    own and are refused by name rather than tokenized differently from the model.
    """
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _GPT2_PRE:
        return byte_level
    raise TokenizerError(
        f"tokenizer.ggml.pre={pre!r} is not supported (smollm, {', '.join(_GPT2_PRE)}): "
        "serve the model's Hugging Face directory instead"
    )


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
        """From `tokenizer.json` + `tokenizer_config.json` (HF or `jlora convert` layout),
        with `chat_template.jinja` and `generation_config.json` where present."""
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise TokenizerError(f"{tok_file} not found")
        backend = _BPE.from_file(str(tok_file))
        config = _json_file(path / "tokenizer_config.json")
        generation = _json_file(path / "generation_config.json")

        def token_id(key: str) -> int | None:
            value = config.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            return backend.token_to_id(value) if isinstance(value, str) else None

        eos = token_id("eos_token")
        eos_ids = list(config.get("eos_token_ids") or ([] if eos is None else [eos]))
        extra = generation.get("eos_token_id")
        for token in extra if isinstance(extra, list) else [extra]:
            if isinstance(token, int) and token not in eos_ids:
                eos_ids.append(token)
        bos, add_bos = config.get("bos_token_id", token_id("bos_token")), False
        if "add_bos_token" in config:
            add_bos = bool(config["add_bos_token"])
        elif (added := _post_processor_bos(tok_file, backend)) is not None:
            bos, add_bos = added, True
        return cls(
            backend,
            bos_id=bos,
            eos_ids=eos_ids,
            add_bos=add_bos,
            chat_template=_chat_template(path, config),
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

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template reads the `tools` it is given."""
        return bool(self.chat_template) and "tools" in _template_variables(self.chat_template)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> str:
        """Render a conversation (and the tools offered, for a template that shows them),
        ending with the assistant's generation prompt."""
        if not self.chat_template:
            raise TokenizerError("this model has no chat template (tokenizer.chat_template)")
        env = _environment()

        def raise_exception(message: str) -> None:
            raise TokenizerError(f"chat template: {message}")

        def strftime_now(format: str) -> str:
            return datetime.datetime.now().strftime(format)

        env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
        env.filters["tojson"] = _tojson

        def special(token_id: int | None) -> str:
            return "" if token_id is None else self.backend.id_to_token(token_id) or ""

        return env.from_string(self.chat_template).render(
            messages=messages,
            tools=tools,
            add_generation_prompt=True,
            bos_token=special(self.bos_id),
            eos_token=special(self.eos_ids[0] if self.eos_ids else None),
        )


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """Jinja as Hugging Face renders chat templates."""
    return jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )


@functools.lru_cache(maxsize=8)
def _template_variables(template: str) -> frozenset[str]:
    """The variables a template reads from its caller (TokenizerError if it does not
    parse)."""
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(_environment().parse(template)))
    except jinja2.TemplateSyntaxError as err:
        raise TokenizerError(f"chat template: line {err.lineno}: {err.message}") from None


def _json_file(file: Path) -> dict[str, Any]:
    """A JSON object file's contents, {} where it is absent; TokenizerError naming it if
    it is not one."""
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise TokenizerError(f"{file}: cannot read it as JSON ({err})") from err
    if not isinstance(data, dict):
        raise TokenizerError(f"{file}: expected a JSON object")
    return data


def _chat_template(path: Path, config: dict[str, Any]) -> str | None:
    """The directory's chat template: `chat_template.jinja` (transformers 5's file), else
    tokenizer_config.json's `chat_template`, a string or a list of named templates (the
    one named "default")."""
    file = path / "chat_template.jinja"
    if file.is_file():
        return file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise TokenizerError(
                f"{path / 'tokenizer_config.json'}: chat_template names {list(named)}, "
                "none of them 'default'"
            )
        return named["default"]
    return template


def _post_processor_bos(tok_file: Path, backend: _BPE) -> int | None:
    """The token id `tokenizer.json`'s post-processor puts before a single sequence (a
    TemplateProcessing that opens with a special token, as Llama 3's adds
    <|begin_of_text|>); None if it adds none."""
    processor = json.loads(tok_file.read_text()).get("post_processor") or {}
    steps = (
        processor.get("processors", [processor])
        if processor.get("type") == "Sequence"
        else [processor]
    )
    for step in steps:
        if step.get("type") != "TemplateProcessing":
            continue
        first = (step.get("single") or [{}])[0]
        if "SpecialToken" in first:
            return backend.token_to_id(first["SpecialToken"]["id"])
    return None


def _tojson(value: Any, indent: int | None = None, **options: Any) -> str:
    """Hugging Face's `tojson` for chat templates: non-ASCII kept, no HTML escaping."""
    return json.dumps(value, ensure_ascii=False, indent=indent, **options)
