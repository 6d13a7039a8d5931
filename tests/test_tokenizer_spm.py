"""SentencePiece BPE ('llama') tokenizers from GGUF, against transformers' reading of the file.

No Llama-2 GGUF is available offline, so each test writes one: the metadata of a toy
vocabulary laid out as Llama-2's is (<unk>, <s>, </s>, the 256 byte pieces, then
normal pieces), with the normal pieces learned from a short English corpus by a naive
SentencePiece BPE training, so their scores rank them as a real model's do.
"""

from __future__ import annotations

import random
from collections import Counter
from itertools import pairwise

import pytest

from jlora.model.gguf import GGUFFile
from jlora.tokenizer import Tokenizer, TokenizerError, merges_from_scores

SPACE = "\u2581"
# GGUF token types (llama.cpp `llama_token_type`).
NORMAL, UNKNOWN, CONTROL, BYTE = 1, 2, 3, 6
# The byte-fallback pieces, ids 3..258 in Llama-2's vocabulary.
BYTE_PIECES = [f"<0x{b:02X}>" for b in range(256)]

CORPUS = """
The history of the printing press begins with the idea that words could be made
to last. Before it, every book was written out by hand, and a single copy of a long
work took months of careful labour. When the first presses came, printers set each
line from small metal letters, inked them, and pressed the paper down on the type.
The price of books fell, more people learned to read, and the ideas of the time
travelled further than they ever had before. Scholars shared their findings, and
the same text could be read in many cities at once. Over the following centuries the
press changed how people thought about learning, about the state, and about the
church. It is often said that the modern world began on the printing floor, with the
smell of ink and the sound of the press, and with the work of the people who ran it.
"""

TEXTS = [
    "Hello world",
    "The printing press changed the world of learning.",
    "  leading spaces, trailing spaces  ",
    "several   spaces\tand\ttabs",
    "one line\ntwo lines\n\nand a blank one\n",
    " ",
    "Quixotic jazz: 42 zebras",  # letters and digits outside the vocabulary
    "caf\u00e9 na\u00efve \u65e5\u672c \U0001f389",  # café naïve 日本 🎉: byte fallback
]


def train_pieces(corpus: str, merges: int) -> tuple[list[str], list[tuple[str, str]]]:
    """Naive SentencePiece BPE training: (pieces, best first; the merges that made them).

    Words are split on whitespace and start with '▁'. Each step joins the most frequent
    adjacent pair of symbols (ties: the larger pair); the single characters follow
    the merged pieces, most frequent first, as in a SentencePiece vocabulary.
    """
    words = Counter(SPACE + word for word in corpus.split())
    symbols = {word: list(word) for word in words}
    learned: list[str] = []
    made_by: list[tuple[str, str]] = []
    for _ in range(merges):
        pairs: Counter[tuple[str, str]] = Counter()
        for word, count in words.items():
            for pair in pairwise(symbols[word]):
                pairs[pair] += count
        if not pairs:
            break
        left, right = max(pairs, key=lambda pair: (pairs[pair], pair))
        made_by.append((left, right))
        if left + right not in learned:
            learned.append(left + right)
        for parts in symbols.values():
            i = 0
            while i < len(parts) - 1:
                if (parts[i], parts[i + 1]) == (left, right):
                    parts[i : i + 2] = [left + right]
                i += 1
    chars = Counter("".join(word * count for word, count in words.items()))
    return learned + sorted(chars, key=lambda c: (-chars[c], c)), made_by


def llama_cpp_reference(fields: dict, text: str) -> list[int]:
    """llama.cpp's SentencePiece tokenization, naive: BOS, then the text's pieces.

    Spaces become '▁' and one is prepended; starting from single characters, the
    adjacent pair whose join is the highest-scoring vocabulary piece is joined
    (ties: the leftmost), until no pair joins; a character left outside the
    vocabulary becomes its UTF-8 bytes' pieces.
    """
    tokens, scores = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.scores"]
    normal = {t: i for i, t in enumerate(tokens) if fields["tokenizer.ggml.token_type"][i] == 1}
    symbols = list(SPACE + text.replace(" ", SPACE)) if text else []
    while True:
        joins = [
            (scores[normal[left + right]], at)
            for at, (left, right) in enumerate(pairwise(symbols))
            if left + right in normal
        ]
        if not joins:
            break
        _, at = max(joins, key=lambda join: (join[0], -join[1]))
        symbols[at : at + 2] = [symbols[at] + symbols[at + 1]]
    ids = [1]
    for symbol in symbols:
        if symbol in normal:
            ids.append(normal[symbol])
        else:
            ids.extend(tokens.index(f"<0x{b:02X}>") for b in symbol.encode())
    return ids


def random_texts(count: int, seed: int = 0) -> list[str]:
    """Runs of corpus words, cut short or extended, and strings of random characters."""
    rng = random.Random(seed)
    words = CORPUS.split()
    alphabet = [*sorted(set(CORPUS)), "  ", "\u00e9", "\u65e5", "Z"]
    texts = []
    for _ in range(count):
        if rng.random() < 0.5:
            picked = (rng.choice(words)[: rng.randint(1, 12)] for _ in range(rng.randint(1, 6)))
            texts.append(" ".join(word + rng.choice(["", "s", "ing", "ed"]) for word in picked))
        else:
            texts.append("".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30))))
    return texts


def write_llama_gguf(path, *, add_space_prefix: bool = True, with_merges: bool = False) -> None:
    """Tokenizer metadata and the hyperparameters transformers reads; no tensors."""
    import gguf

    pieces, made_by = train_pieces(CORPUS, merges=300)
    pieces[10:10] = [SPACE * 2, SPACE * 4]  # runs of spaces, as Llama-2 has
    tokens = ["<unk>", "<s>", "</s>", *BYTE_PIECES, *pieces]
    types = [UNKNOWN, CONTROL, CONTROL, *[BYTE] * 256, *[NORMAL] * len(pieces)]
    # Log-probability-like scores: the specials and bytes 0, pieces falling with rank.
    scores = [0.0] * 259 + [-float(rank) for rank in range(len(pieces))]

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("toy-llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(add_space_prefix)
    if with_merges:
        writer.add_token_merges([f"{left} {right}" for left, right in made_by])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def load_both(path):
    """(ours, transformers') tokenizers for one GGUF file."""
    from transformers import AutoTokenizer

    ours = Tokenizer.from_gguf_fields(GGUFFile(path).fields)
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return ours, theirs


def their_ids(theirs, text: str) -> list[int]:
    """transformers' ids for the text, after BOS.

    transformers 5 loads this GGUF as a generic `TokenizersBackend` whose post-processor
    adds nothing, whatever `tokenizer.ggml.add_bos_token` says; llama.cpp (and we)
    start with BOS, so it is prepended here.
    """
    return [1, *theirs.encode(text, add_special_tokens=False)]


@pytest.fixture(scope="module")
def toy_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("spm") / "toy-llama.gguf"
    write_llama_gguf(path)
    return path


@pytest.fixture(scope="module")
def toy(toy_path):
    return load_both(toy_path)


@pytest.mark.parametrize("text", TEXTS)
def test_encoding_matches_transformers(toy, text):
    ours, theirs = toy
    assert ours.encode(text) == their_ids(theirs, text)


def test_encoding_matches_llama_cpp_reference(toy, toy_path):
    ours, _ = toy
    fields = GGUFFile(toy_path).fields
    for text in [*TEXTS, *random_texts(300)]:
        assert ours.encode(text) == llama_cpp_reference(fields, text), repr(text)


def test_tiny_vocabulary_joins_the_best_pair_leftmost_first():
    pieces = [SPACE, "a", "b", "ab", "ba"]
    fields = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>", *BYTE_PIECES, *pieces],
        "tokenizer.ggml.scores": [0.0] * 259 + [-5.0, -6.0, -7.0, -1.0, -0.5],
        "tokenizer.ggml.token_type": [UNKNOWN, CONTROL, CONTROL, *[BYTE] * 256, *[NORMAL] * 5],
    }
    ours = Tokenizer.from_gguf_fields(fields)
    cases = {
        # ▁ a b a: 'ab' (-1) and 'ba' (-0.5) could join; 'ba' scores higher.
        "aba": ["<s>", SPACE, "a", "ba"],
        # ▁ a b a b: 'ba' at 2; then ▁ a ba b: nothing joins.
        "abab": ["<s>", SPACE, "a", "ba", "b"],
        # ▁ a b ▁ a b: 'ab' at 1 and 4 tie; either way both join. 'c' is byte 0x63.
        "ab abc": ["<s>", SPACE, "ab", SPACE, "ab", "<0x63>"],
    }
    for text, expected in cases.items():
        reference = llama_cpp_reference(fields, text)
        assert [fields["tokenizer.ggml.tokens"][i] for i in reference] == expected, text
        assert ours.encode(text) == reference, text


@pytest.mark.parametrize("text", TEXTS)
def test_decode_inverts_encode(toy, text):
    ours, _ = toy
    assert ours.decode(ours.encode(text)) == text


def test_pieces_of_a_sentence(toy):
    """'▁' for every space, one prepended, learned pieces joined, BOS first."""
    ours, _ = toy
    ids = ours.encode("the press")
    assert ids[0] == ours.bos_id == 1
    assert [ours.backend.id_to_token(i) for i in ids[1:]] == [f"{SPACE}the", f"{SPACE}press"]


def test_unknown_characters_fall_back_to_bytes(toy):
    ours, _ = toy
    ids = ours.encode("\u00e9")  # é = C3 A9, after the prepended '▁'
    assert [ours.backend.id_to_token(i) for i in ids] == ["<s>", SPACE, "<0xC3>", "<0xA9>"]


def test_special_tokens(toy):
    ours, theirs = toy
    assert ours.eos_ids == [2]
    # A control token in the text is one id; llama.cpp, like transformers, prepends a
    # space to the text after it, so decoding (which drops the token) shows that space.
    text = "the end</s>the start"
    assert ours.encode(text) == their_ids(theirs, text)
    assert ours.encode(text).count(2) == 1
    assert ours.decode(ours.encode(text)) == "the end the start"


@pytest.mark.parametrize(
    "options", [{"with_merges": True}, {"add_space_prefix": False}], ids=["merges", "no-prefix"]
)
def test_file_variants_match_transformers(tmp_path, options):
    """Merges given in the file (not derived), and no space prepended."""
    path = tmp_path / "variant.gguf"
    write_llama_gguf(path, **options)
    ours, theirs = load_both(path)
    for text in TEXTS:
        assert ours.encode(text) == their_ids(theirs, text), text
        assert ours.decode(ours.encode(text)) == text


def test_merges_from_scores_rank_by_the_joined_piece():
    # Pieces and scores: "a" -2, "b" -3, "c" -4, "ab" -1, "bc" -0.5, "abc" -0.1, "<s>" 0.
    # Every split of a normal piece into two normal pieces is a merge, ranked by the
    # joined piece's score: abc (-0.1) from a+bc and ab+c, then bc (-0.5), then ab (-1).
    # "<s>" is control: never a merge result, though "<" + "s>" spells it.
    tokens = ["a", "b", "c", "ab", "bc", "abc", "<s>", "<", "s>"]
    scores = [-2.0, -3.0, -4.0, -1.0, -0.5, -0.1, 0.0, -5.0, -6.0]
    types = [NORMAL] * 6 + [CONTROL, NORMAL, NORMAL]
    assert merges_from_scores(tokens, scores, types) == [
        ("a", "bc"),
        ("ab", "c"),
        ("b", "c"),
        ("a", "b"),
    ]


def test_unsupported_model_kind_names_the_field():
    with pytest.raises(TokenizerError, match=r"tokenizer\.ggml\.model='bert'"):
        Tokenizer.from_gguf_fields({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": []})


def test_scores_are_required_without_merges():
    fields = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>"]}
    with pytest.raises(TokenizerError, match=r"tokenizer\.ggml\.scores"):
        Tokenizer.from_gguf_fields(fields)
