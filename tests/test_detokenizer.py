"""Incremental detokenization and stop strings, with a one-character-per-token stand-in."""

from __future__ import annotations

from jlora.engine.detokenizer import Detokenizer


class CharTokenizer:
    """Token id = Unicode code point; id 0xFFFD stands for an incomplete byte sequence."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(map(chr, ids))


def _feed(text: str, stop: tuple[str, ...]) -> tuple[list[str], bool, Detokenizer]:
    detok = Detokenizer(CharTokenizer(), stop)  # type: ignore[arg-type]
    deltas, stopped = [], False
    for char in text:
        delta, stopped = detok.add(ord(char))
        deltas.append(delta)
        if stopped:
            break
    return deltas, stopped, detok


def test_without_stop_strings_every_token_is_released_at_once():
    deltas, stopped, _ = _feed("hello", ())
    assert deltas == list("hello") and not stopped


def test_text_that_may_start_a_stop_string_is_held_back():
    # stop "END": the last len("END") - 1 = 2 characters could begin it -> held back
    deltas, stopped, detok = _feed("abEx", ("END",))
    assert not stopped
    assert deltas == ["", "", "a", "b"]
    assert detok.flush() == "Ex"


def test_stop_string_cuts_the_text_and_finishes():
    deltas, stopped, detok = _feed("The answer is 4.\nQ: next", ("\nQ:",))
    assert stopped
    assert "".join(deltas) == "The answer is 4."
    assert detok.text == "The answer is 4."


def test_earliest_of_several_stop_strings_wins():
    _, stopped, detok = _feed("one two three", ("three", "two"))
    assert stopped and detok.text == "one "


def test_incomplete_character_is_not_released():
    detok = Detokenizer(CharTokenizer(), ())  # type: ignore[arg-type]
    assert detok.add(ord("a")) == ("a", False)
    assert detok.add(0xFFFD) == ("", False)


class ByteTokenizer:
    """Token id = one UTF-8 byte, as in byte-level BPE's worst case."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def test_multibyte_characters_split_across_tokens_come_out_whole():
    text = "café 日本 🎉 ok"
    detok = Detokenizer(ByteTokenizer(), ())  # type: ignore[arg-type]
    deltas = [detok.add(b)[0] for b in text.encode()]
    assert "".join(deltas) + detok.flush() == text
    assert all("\ufffd" not in d for d in deltas)
    assert deltas[text.encode().index("🎉".encode()) + 3] == "🎉"  # released on its 4th byte
