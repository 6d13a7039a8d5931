"""Tool calls in a model's text: the formats chat templates ask models to write them in,
and parsers that take them back out, token by token, into OpenAI's shape.

The worker knows its chat template and reports the format it writes (`detect`, or the
`--tool-call-parser` it was started with) in its Models reply; the router parses each
choice's text with `parser()` (vLLM's `--tool-call-parser` names):

- `hermes` (Hermes 2 Pro, Qwen2/2.5, and many fine-tunes): any text, then calls as
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block each;
- `llama3_json` (Llama 3.1-3.3's JSON tool calling): the whole reply is one call
  `{"name": ..., "parameters": {...}}` (or several joined by `;`), optionally after
  `<|python_tag|>`.

Two more parsers serve OpenAI's forced tool choices, whose text a grammar shapes
(`forced_schema`): `named` (the text is one named call's arguments) and `required` (a
JSON array of calls, each `{"name", "parameters"}`).

A parser is fed a choice's text as it streams (`feed`), then told it ended (`finish`);
each returns a `Delta`: the text that is content, and the tool calls' parts so far.
Nothing is lost: text that turns out not to be a well-formed call is content, as sent.
Fed its text all at once, a parser gives what it gives fed token by token.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any

FORMATS = ("hermes", "llama3_json")
# The marks by which `detect` knows a template's format.
_MARKS = {"hermes": ("<tool_call>",), "llama3_json": ("<|python_tag|>", "ipython")}
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a function's name


def bad_name(name: str) -> str | None:
    """Why `name` is not a function name OpenAI accepts (None: it is one)."""
    return None if _NAME.match(name) else f"{name!r} must be 1 to 64 letters, digits, '_' or '-'"


def detect(template: str | None) -> str:
    """The tool-call format `template` asks for ("" when it shows no tools, or writes
    them in a format jlora does not parse)."""
    if not template or "tools" not in template:
        return ""
    for name in FORMATS:
        if any(mark in template for mark in _MARKS[name]):
            return name
    return ""


@dataclasses.dataclass
class CallDelta:
    """A part of tool call `index`: its id, type and name the first time it appears, then
    more of its arguments (JSON text)."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def openai(self) -> dict[str, Any]:
        """As a stream chunk's delta.tool_calls[i]."""
        function: dict[str, Any] = {"arguments": self.arguments}
        item: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            item.update(id=self.id, type="function")
            function["name"] = self.name
        item["function"] = function
        return item


@dataclasses.dataclass
class Delta:
    content: str = ""
    calls: list[CallDelta] = dataclasses.field(default_factory=list)

    def add(self, other: Delta) -> Delta:
        self.content += other.content
        self.calls += other.calls
        return self


class Parser:
    """A choice's text as content and tool calls; see the module docstring."""

    def __init__(self) -> None:
        self.count = 0  # the calls begun

    def feed(self, text: str) -> Delta:
        raise NotImplementedError

    def finish(self) -> Delta:
        return Delta()

    def _call(self, name: str, arguments: str) -> CallDelta:
        call = CallDelta(self.count, arguments, id=f"call_{uuid.uuid4().hex[:24]}", name=name)
        self.count += 1
        return call


def parser(kind: str, *, name: str = "") -> Parser:
    """A parser for `kind`: one of FORMATS, "named" (the call to `name`) or "required"."""
    if kind == "hermes":
        return Hermes()
    if kind == "llama3_json":
        return Llama3Json()
    if kind == "named":
        return Named(name)
    if kind == "required":
        return Required()
    raise ValueError(f"no tool-call parser {kind!r} (known: {[*FORMATS, 'named', 'required']})")


def whole(p: Parser, text: str) -> tuple[str, list[dict[str, Any]]]:
    """`text` parsed at once: its content and its calls in OpenAI's message shape."""
    delta = p.feed(text).add(p.finish())
    return delta.content, calls(delta.calls)


def calls(parts: list[CallDelta]) -> list[dict[str, Any]]:
    """Calls' parts joined into whole calls, OpenAI's message.tool_calls."""
    joined: dict[int, dict[str, Any]] = {}
    for part in parts:
        if part.id is not None:
            joined[part.index] = {
                "id": part.id,
                "type": "function",
                "function": {"name": part.name, "arguments": ""},
            }
        joined[part.index]["function"]["arguments"] += part.arguments
    return [joined[i] for i in sorted(joined)]


def _call_fields(value: Any, arguments_key: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a call object, or None if `value` is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, value.get("arguments", {}))
    if isinstance(arguments, str):
        return value["name"], arguments
    if not isinstance(arguments, dict):
        return None
    return value["name"], json.dumps(arguments, ensure_ascii=False)


def _held(text: str, mark: str) -> int:
    """How many characters at the end of `text` could begin `mark`."""
    for size in range(min(len(text), len(mark) - 1), 0, -1):
        if mark.startswith(text[-size:]):
            return size
    return 0


class Hermes(Parser):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self._buffer = ""
        self._inside = False

    def feed(self, text: str) -> Delta:
        self._buffer += text
        out = Delta()
        while True:
            if self._inside:
                end = self._buffer.find(self.CLOSE)
                if end < 0:
                    return out
                out.add(self._block(self._buffer[:end], closed=True))
                self._buffer = self._buffer[end + len(self.CLOSE) :]
                self._inside = False
                continue
            start = self._buffer.find(self.OPEN)
            if start < 0:
                sent = len(self._buffer) - _held(self._buffer, self.OPEN)
                if self.count:  # whitespace after a call waits: dropped if a call follows
                    sent = len(self._buffer[:sent].rstrip())
                out.content += self._buffer[:sent]
                self._buffer = self._buffer[sent:]
                return out
            before = self._buffer[:start]
            out.content += "" if self.count and not before.strip() else before
            self._buffer = self._buffer[start + len(self.OPEN) :]
            self._inside = True

    def finish(self) -> Delta:
        rest, self._buffer = self._buffer, ""
        if self._inside:
            self._inside = False
            return self._block(rest, closed=False)
        return Delta("" if self.count and not rest.strip() else rest)

    def _block(self, body: str, *, closed: bool) -> Delta:
        try:
            fields = _call_fields(json.loads(body), "arguments")
        except json.JSONDecodeError:
            fields = None
        if fields is None:  # not a call after all: the text as it came
            return Delta(self.OPEN + body + (self.CLOSE if closed else ""))
        return Delta(calls=[self._call(*fields)])


class _Objects(Parser):
    """Calls as JSON objects one after another, `separator` between them, optionally
    inside `brackets`; text that does not follow that shape is content."""

    arguments_key = "parameters"
    separator = ";"
    brackets = ("", "")

    def __init__(self) -> None:
        super().__init__()
        self._buffer = ""
        self._mode = "start"  # then "calls" (objects expected), "content" or "done"
        self._decoder = json.JSONDecoder()

    def feed(self, text: str) -> Delta:
        self._buffer += text
        if self._mode == "start":
            head = self._start(self._buffer.lstrip())
            if head is None:
                return Delta()
            self._mode, self._buffer = head
        if self._mode == "content":
            rest, self._buffer = self._buffer, ""
            return Delta(rest)
        if self._mode == "calls":
            return self._objects()
        return Delta()

    def finish(self) -> Delta:
        out = self._objects() if self._mode == "calls" else Delta()
        rest, self._buffer = self._buffer, ""
        if self._mode == "start" or rest.strip():
            out.content += rest
        return out

    def _start(self, head: str) -> tuple[str, str] | None:
        """(mode, buffer) once the text's start (`head`, without its leading whitespace)
        decides it; None while it cannot."""
        opening = self.brackets[0]
        if opening:
            if not head:
                return None
            if not head.startswith(opening):
                return "content", self._buffer
            head = head[len(opening) :].lstrip()
        if not head:
            return None
        return ("calls", head) if head.startswith("{") else ("content", self._buffer)

    def _objects(self) -> Delta:
        out = Delta()
        while self._mode == "calls":
            body = self._buffer.lstrip()
            if self.count:  # a separator, or the closing bracket, before the next object
                if body.startswith(self.separator):
                    body = body[len(self.separator) :].lstrip()
                elif self.brackets[1] and body.startswith(self.brackets[1]):
                    self._mode, self._buffer = "done", body[len(self.brackets[1]) :]
                    return out
                else:  # nothing yet, or text after the calls (content, at the finish)
                    return out
            try:
                value, end = self._decoder.raw_decode(body)
            except json.JSONDecodeError:
                return out
            fields = _call_fields(value, self.arguments_key)
            if fields is None:
                self._mode = "content"
                out.content += self._buffer
                self._buffer = ""
                return out
            out.calls.append(self._call(*fields))
            self._buffer = body[end:]
        return out


class Llama3Json(_Objects):
    def _start(self, head: str) -> tuple[str, str] | None:
        tag = "<|python_tag|>"
        if len(head) < len(tag) and tag.startswith(head):
            return None
        return super()._start(head.removeprefix(tag).lstrip())


class Required(_Objects):
    """The JSON array a `required` tool choice's grammar shapes."""

    separator = ","
    brackets = ("[", "]")


class Named(Parser):
    """The text is the arguments of the one call to `name` (a named tool choice)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def feed(self, text: str) -> Delta:
        if self.count == 0:
            return Delta(calls=[self._call(self.name, text)])
        return Delta(calls=[CallDelta(0, text)]) if text else Delta()


def forced_schema(tools: list[dict[str, Any]], choice: Any, *, parallel: bool) -> dict[str, Any]:
    """The JSON schema a forced tool choice's text follows: the named function's
    parameters, or (`"required"`) an array of at least one call of any tool (at most one
    unless `parallel`)."""

    def parameters(tool: dict[str, Any]) -> dict[str, Any]:
        return tool["function"].get("parameters") or {"type": "object"}

    if choice != "required":
        name = choice["function"]["name"]
        return parameters(next(t for t in tools if t["function"]["name"] == name))
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t["function"]["name"]}, "parameters": parameters(t)},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        array["maxItems"] = 1
    return array
