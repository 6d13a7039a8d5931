"""Tools through `jlora up` and the official openai client, SmolLM2 served with each of
the tool templates in configs/chat_templates: calls in the template's format parsed
(tool_choice "auto", whole and streamed), a named function's arguments and a required
call shaped by their grammar and valid against the tools' schemas, a conversation with
calls and their results, and the tools reaching the template.

SmolLM2 writes no tool calls of its own, so the "auto" tests make it write one with a
grammar (vLLM's structured_outputs), as a model trained for tools would.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TEMPLATES = Path(__file__).parent.parent / "configs" / "chat_templates"
WEATHER = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Rome", "Oslo"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}  # fmt: skip
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
         "required": ["zone"], "additionalProperties": False}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "A forecast.",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}},
]  # fmt: skip
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
USER = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]
# A call to get_weather as each template asks for it.
WRITTEN = {
    "chatml-hermes": '<tool_call>\n{"name": "get_weather", "arguments": '
    '{"city": "Paris", "days": 3}}\n</tool_call>',
    "chatml-json": '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}',
}


@pytest.fixture(scope="module", params=["chatml-hermes", "chatml-json"])
def served(request, tmp_path_factory):
    """(template name, client) of `jlora up` with that template: the Hermes one's format
    detected, the JSON one's named with --tool-call-parser."""
    import openai

    from bench.lib.processes import ServerProcess
    from jlora.cli.up import LISTENING

    flags = ["--chat-template", str(TEMPLATES / f"{request.param}.jinja")]
    if request.param == "chatml-json":
        flags += ["--tool-call-parser", "llama3_json"]
    process = ServerProcess(
        [sys.executable, "-m", "jlora.cli.main", "up", "--port", "0", "--http-port", "0",
         "--state-dir", str(tmp_path_factory.mktemp("state")), "--warmup", "on-demand",
         "--workers", "1", "--max-seq-len", "1024", *flags],
        LISTENING, stdout="inherit", stderr="log", start_timeout_s=600,
    )  # fmt: skip
    client = openai.OpenAI(base_url=process.groups[1], api_key="unused", max_retries=0)
    yield request.param, client
    client.close()
    process.stop(120, group=True)


def _chat(client, messages=USER, **kwargs):
    kwargs.setdefault("max_tokens", 100)
    return client.chat.completions.create(model="smollm2-135m", messages=messages, **kwargs)


def _streamed(stream) -> tuple[str, list[dict], str, list]:
    """A stream's content, calls (joined from their deltas), finish reason and the
    tool-call deltas as they came."""
    content, calls, deltas, finish = "", {}, [], None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or ():
            deltas.append(delta)
            if delta.id is not None:
                calls[delta.index] = {"id": delta.id, "name": delta.function.name, "arguments": ""}
            calls[delta.index]["arguments"] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish, deltas


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or ()]


def test_calls_in_the_templates_format_come_back_as_tool_calls(served):
    name, client = served
    forced = {"structured_outputs": {"choice": [WRITTEN[name]]}}
    reply = _chat(client, tools=TOOLS, extra_body=forced)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert _calls(choice.message) == [("get_weather", {"city": "Paris", "days": 3})]
    assert choice.message.tool_calls[0].id.startswith("call_")
    content, calls, finish, _ = _streamed(
        _chat(client, tools=TOOLS, tool_choice="auto", extra_body=forced, stream=True)
    )
    assert (content, finish) == ("", "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == _calls(choice.message)


def test_a_reply_without_a_call_is_content_and_the_tools_reach_the_template(served):
    _, client = served
    plain = _chat(client, max_tokens=8)
    offered = _chat(client, tools=TOOLS, max_tokens=8)
    declined = _chat(client, tools=TOOLS, tool_choice="none", max_tokens=8)
    for reply in (offered, declined):
        assert (
            reply.choices[0].message.tool_calls is None or reply.choices[0].message.tool_calls == []
        )
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert isinstance(reply.choices[0].message.content, str)
    assert offered.usage.prompt_tokens == declined.usage.prompt_tokens
    assert offered.usage.prompt_tokens > plain.usage.prompt_tokens + 50  # the tools' JSON


def test_a_named_function_gets_arguments_that_follow_its_schema(served):
    import jsonschema

    _, client = served
    choice = {"type": "function", "function": {"name": "get_weather"}}
    reply = _chat(client, tools=TOOLS, tool_choice=choice).choices[0]
    assert reply.finish_reason == "stop"  # as OpenAI's, for a forced function
    ((called, arguments),) = _calls(reply.message)
    assert called == "get_weather"
    jsonschema.validate(arguments, WEATHER)
    content, calls, finish, deltas = _streamed(
        _chat(client, tools=TOOLS, tool_choice=choice, stream=True)
    )
    assert (content, finish, len(calls)) == ("", "stop", 1)
    assert deltas[0].function.name == "get_weather" and len(deltas) > 1  # arguments as they come
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER)


def test_required_makes_one_call_or_several_each_valid(served):
    """At most one with parallel_tool_calls false; any number, each whole call valid,
    without."""
    import jsonschema

    _, client = served
    one = _chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert one.choices[0].finish_reason == "tool_calls"
    ((called, arguments),) = _calls(one.choices[0].message)
    jsonschema.validate(arguments, SCHEMAS[called])
    content, calls, finish, _ = _streamed(
        _chat(client, tools=TOOLS, tool_choice="required", stream=True, max_tokens=300)
    )
    assert calls and finish in ("tool_calls", "length")  # a long array may be cut
    assert content == "" or finish == "length"  # the call it cut, as text
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_a_conversation_with_calls_and_their_results(served):
    _, client = served
    history = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, then rain"},
    ]  # fmt: skip
    reply = _chat(client, history, tools=TOOLS, max_tokens=8)
    assert reply.choices[0].finish_reason in ("stop", "length")
    shorter = _chat(client, history[:1], tools=TOOLS, max_tokens=8)
    assert reply.usage.prompt_tokens > shorter.usage.prompt_tokens  # the call and its result
