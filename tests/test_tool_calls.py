"""The tool-call formats (jlora.contract.tool_calls): each parser's content and calls
for texts in its format and for texts that only look like it, the same whether the
text comes at once or token by token; the format a template asks for."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from jlora.contract.tool_calls import calls, detect, forced_schema, parser, whole

LLAMA_F = '{"name": "f", "parameters": {}}'
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
CASES = [
    # (kind, text, content, [(name, arguments as objects)])
    ("hermes", f"Let me look.\n<tool_call>\n{WEATHER}\n</tool_call>", "Let me look.\n",
     [("get_weather", {"city": "Paris"})]),
    ("hermes", f"<tool_call>{WEATHER}</tool_call>\n<tool_call>\n"
     '{"name": "now", "arguments": {}}\n</tool_call>\n', "",
     [("get_weather", {"city": "Paris"}), ("now", {})]),
    ("hermes", 'a < b and <tool but <tool_cal', 'a < b and <tool but <tool_cal', []),
    ("hermes", "<tool_call>{not json}</tool_call> after", "<tool_call>{not json}</tool_call> after",
     []),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": [1, 2]}}', "", [("f", {"x": [1, 2]})]),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"q\\": \\"é\\"}"}</tool_call>', "",
     [("f", {"q": "é"})]),
    ("hermes", f"<tool_call>{WEATHER}</tool_call> Done.", " Done.",
     [("get_weather", {"city": "Paris"})]),
    ("llama3_json", '{"name": "f", "parameters": {"x": 1}}', "", [("f", {"x": 1})]),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {}}; '
     '{"name": "g", "parameters": {"y": "é"}}', "", [("f", {}), ("g", {"y": "é"})]),
    ("llama3_json", "  Hello " + LLAMA_F, "  Hello " + LLAMA_F,
     []),
    ("llama3_json", '{"answer": 1}', '{"answer": 1}', []),
    ("llama3_json", LLAMA_F[:-4], LLAMA_F[:-4], []),
    ("llama3_json", "", "", []),
    ("required", '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]', "",
     [("f", {"a": 1}), ("g", {})]),
    ("required", ' [ {"name": "f", "parameters": {}} ]', "", [("f", {})]),
]  # fmt: skip


def _pieces(text: str, seed: int) -> list[str]:
    """`text` cut at random places, pieces of 1 to 4 characters (a token's text)."""
    rng, pieces, at = random.Random(seed), [], 0
    while at < len(text):
        size = rng.randint(1, 4)
        pieces.append(text[at : at + size])
        at += size
    return pieces


def _streamed(kind: str, text: str, seed: int) -> tuple[str, list[dict]]:
    p = parser(kind)
    deltas = [p.feed(piece) for piece in _pieces(text, seed)] + [p.finish()]
    return "".join(d.content for d in deltas), calls([c for d in deltas for c in d.calls])


@pytest.mark.parametrize(("kind", "text", "content", "expected"), CASES)
def test_a_parser_gives_the_content_and_calls_at_once_and_token_by_token(
    kind, text, content, expected
):
    for got_content, got_calls in [whole(parser(kind), text)] + [
        _streamed(kind, text, seed) for seed in range(20)
    ]:
        assert got_content == content
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in got_calls] == expected  # fmt: skip
        assert all(c["type"] == "function" and c["id"].startswith("call_") for c in got_calls)
        assert len({c["id"] for c in got_calls}) == len(got_calls)


def test_a_named_call_streams_its_arguments_as_they_come():
    p = parser("named", name="lookup")
    first, second, last = p.feed('{"q": '), p.feed('"x"}'), p.finish()
    assert first.content == second.content == last.content == ""
    assert first.calls[0].openai() == {
        "index": 0, "id": first.calls[0].id, "type": "function",
        "function": {"name": "lookup", "arguments": '{"q": '},
    }  # fmt: skip
    assert second.calls[0].openai() == {"index": 0, "function": {"arguments": '"x"}'}}
    assert calls(first.calls + second.calls)[0]["function"]["arguments"] == '{"q": "x"}'


def test_the_forced_schemas_accept_calls_and_refuse_others():
    import jsonschema

    tools = [
        {"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}},
        {"type": "function", "function": {"name": "g"}},
    ]  # fmt: skip
    named = forced_schema(tools, {"type": "function", "function": {"name": "f"}}, parallel=True)
    jsonschema.validate({"a": 1}, named)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"a": "x"}, named)
    required = forced_schema(tools, "required", parallel=True)
    jsonschema.validate([{"name": "f", "parameters": {"a": 2}}, {"name": "g", "parameters": {}}],
                        required)  # fmt: skip
    for bad in ([], [{"name": "h", "parameters": {}}], [{"name": "f", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, required)
    one = forced_schema(tools, "required", parallel=False)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "g", "parameters": {}}] * 2, one)


def test_the_format_a_template_asks_for():
    hermes = "{% if tools %}<tools>{{ tools | tojson }}</tools> write <tool_call>{% endif %}"
    llama = '{%- if tools %}{{- "<|python_tag|>" }}{% for t in tools %}{{ t | tojson }}{% endfor %}'
    assert detect(hermes) == "hermes" and detect(llama) == "llama3_json"
    assert detect("{% for m in messages %}{{ m.content }}{% endfor %}") == ""
    assert detect("{{ tools }} [TOOL_CALLS]") == ""  # Mistral's: not parsed
    assert detect(None) == ""
    with pytest.raises(ValueError, match="no tool-call parser 'mistral'"):
        parser("mistral")


# -- the templates in configs/chat_templates ----------------------------------------------

TEMPLATES = Path(__file__).parent.parent / "configs" / "chat_templates"
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather.",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "now"}},
]  # fmt: skip
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris, and the time?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": {}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 °C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
]  # fmt: skip


@pytest.mark.parametrize(("file", "format"), [("chatml-hermes", "hermes"), ("chatml-json", "")])
def test_the_tool_templates_render_as_transformers_renders_them(file, format):
    """Our renderer and transformers' give the same text for a conversation with tools,
    calls and their results, with and without a system turn; a call the template shows
    parses back with the format's parser; `detect` knows the Hermes one by its tag."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models
    from transformers import PreTrainedTokenizerFast

    from jlora.tokenizer import Tokenizer

    template = (TEMPLATES / f"{file}.jinja").read_text()
    theirs = PreTrainedTokenizerFast(tokenizer_object=Backend(models.BPE()))
    ours = Tokenizer(Backend(models.BPE()), bos_id=None, eos_ids=[], add_bos=False,
                     chat_template=template)  # fmt: skip
    assert ours.renders_tools and detect(template) == format
    for messages, tools in [(CONVERSATION, TOOLS), (CONVERSATION[1:], TOOLS),
                            (CONVERSATION[:2], None), (CONVERSATION[1:2], None)]:  # fmt: skip
        expected = theirs.apply_chat_template(
            messages, tools=tools, chat_template=template, tokenize=False,
            add_generation_prompt=True,
        )  # fmt: skip
        assert ours.apply_chat_template(messages, tools) == expected
        assert ("get_weather" in expected) == (tools is not None)
    shown = ours.apply_chat_template(CONVERSATION[:3], TOOLS)
    reply = shown.rsplit("<|im_start|>assistant\n", 2)[1].removesuffix("<|im_end|>\n")
    _, parsed = whole(parser(format or "llama3_json"), reply)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed] == [
        ("get_weather", {"city": "Paris"}), ("now", {})
    ]  # fmt: skip


# -- a worker's chat with tools (jlora.server.convert) ------------------------------------


def _chat_request(tools=(), **message):
    from jlora.api import jlora_pb2 as pb

    msg = pb.GenerateRequest()
    msg.chat.messages.add(role="user", content="hi")
    if message:
        msg.chat.messages.add(**message)
    msg.chat.tools.extend(tools)
    return msg


def _to_request(msg, tokenizer):
    from jlora.engine.api import SamplingParams
    from jlora.server.convert import to_request

    return to_request(msg, request_id="r", tokenizer=tokenizer, max_seq_len=4096,
                      base_model="base", arrival_time=0.0, defaults=SamplingParams())  # fmt: skip


def test_a_workers_chat_shows_the_tools_and_calls_in_openais_shape():
    from jlora.api import jlora_pb2 as pb
    from jlora.engine.mock import MockTokenizer

    tokenizer = MockTokenizer()
    tool = pb.Tool(name="get_weather", description="A forecast.", parameters='{"type": "object"}')
    msg = _chat_request(
        [tool], role="assistant", tool_calls=[pb.ToolCall(id="c1", name="get_weather",
                                                          arguments='{"city": "Paris"}')],
    )  # fmt: skip
    msg.chat.messages.add(role="tool", content="sunny", tool_call_id="c1", name="get_weather")
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"},
         {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
          "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
         {"role": "tool", "content": "sunny", "name": "get_weather", "tool_call_id": "c1"}],
        [{"type": "function", "function": {"name": "get_weather", "description": "A forecast.",
                                           "parameters": {"type": "object"}}}],
    )  # fmt: skip
    assert _to_request(msg, tokenizer).prompt_ids == tokenizer.encode(expected)


@pytest.mark.parametrize(
    ("tools", "message", "field", "names"),
    [
        ([{"name": "a b"}], {}, "prompt.chat.tools[0].name", "letters"),
        ([{"name": "f", "parameters": "{"}], {}, "prompt.chat.tools[0].parameters", "not JSON"),
        ([{"name": "f", "parameters": "[]"}], {}, "prompt.chat.tools[0].parameters", "object"),
        ([], {"role": "assistant", "tool_calls": [{"name": "f", "arguments": "1"}]},
         "prompt.chat.messages[1].tool_calls[0].arguments", "JSON object"),
        ([], {"role": "robot"}, "prompt.chat.messages[1].role", "'tool'"),
    ],
)  # fmt: skip
def test_a_workers_bad_tools_and_calls_are_named(tools, message, field, names):
    from jlora.api import jlora_pb2 as pb
    from jlora.contract.errors import InvalidRequest
    from jlora.engine.mock import MockTokenizer

    if "tool_calls" in message:
        message = {**message, "tool_calls": [pb.ToolCall(**c) for c in message["tool_calls"]]}
    msg = _chat_request([pb.Tool(**t) for t in tools], **message)
    with pytest.raises(InvalidRequest, match=names) as caught:
        _to_request(msg, MockTokenizer())
    assert caught.value.field == field


def test_a_template_without_tools_refuses_them():
    from tokenizers import Tokenizer as Backend
    from tokenizers import models

    from jlora.api import jlora_pb2 as pb
    from jlora.contract.errors import InvalidRequest
    from jlora.tokenizer import Tokenizer

    plain = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    tokenizer = Tokenizer(Backend(models.BPE()), bos_id=None, eos_ids=[], add_bos=False,
                          chat_template=plain)  # fmt: skip
    assert not tokenizer.renders_tools
    with pytest.raises(InvalidRequest, match="shows no tools") as caught:
        _to_request(_chat_request([pb.Tool(name="f")]), tokenizer)
    assert caught.value.field == "prompt.chat.tools"
