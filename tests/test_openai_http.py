"""The router's OpenAI-compatible HTTP API, driven by the official `openai` package (and by
raw HTTP where the client would hide the status or the body), in front of MockEngine
workers on loopback. MockTokenizer decodes token t as " t<t>", so each completion's
text is known exactly from `mock_completion`.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.lib.processes import wait_for
from jlora.api import jlora_pb2 as pb
from jlora.api import jlora_pb2_grpc as pb_grpc
from jlora.engine.mock import MockTokenizer, mock_completion, mock_engine, mock_logprobs
from jlora.server import serve
from router.app import start_router

VOCAB = 1000
TOKENIZER = MockTokenizer()


def expected_text(prompt_ids: list[int], adapter: str | None, n: int) -> str:
    return TOKENIZER.decode(mock_completion(prompt_ids, adapter, n, VOCAB))


def chat_ids(messages: list[dict[str, str]]) -> list[int]:
    return TOKENIZER.encode(TOKENIZER.apply_chat_template(messages))


class Deployment:
    """Two in-process workers (base model "smol", adapters a and b) behind a router."""

    def __init__(self, *, max_seq_len: int = 64, max_slots: int = 4, **router_options) -> None:
        self.engines = [
            mock_engine(
                max_slots=max_slots,
                max_seq_len=max_seq_len,
                step_latency=0.002,
                adapters={"a": 8, "b": 16},
            )
            for _ in range(2)
        ]
        self.workers = [
            serve(engine, tokenizer=engine.tokenizer, model_name="smol", max_queue=0)
            for engine in self.engines
        ]
        self.router = start_router([w.address for w in self.workers], **router_options)
        self.url = f"http://127.0.0.1:{self.router.http_port}"
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)

    def post(self, path: str, body: bytes | dict, headers: dict | None = None):
        """(status, JSON body) of a raw POST."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        message = urllib.request.Request(
            self.url + path,
            data=data,
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        try:
            with urllib.request.urlopen(message, timeout=10) as reply:
                return reply.status, json.loads(reply.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=10) as reply:
                return reply.status, reply.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()

    def idle(self) -> bool:
        return not any(engine.has_unfinished for engine in self.engines) and not (
            self.router.front.in_flight
        )

    def close(self) -> None:
        self.client.close()
        self.router.stop(grace=0)
        for worker in self.workers:
            worker.stop(grace=0)


@pytest.fixture(scope="module")
def deployment():
    deployment = Deployment(poll_interval=0.1)
    yield deployment
    deployment.close()


# -- the openai client -------------------------------------------------------------------


@pytest.mark.parametrize("model, adapter", [("smol", None), ("a", "a"), ("b", "b")])
def test_completions(deployment, model, adapter):
    reply = deployment.client.completions.create(model=model, prompt="Hello", max_tokens=7)
    assert reply.object == "text_completion" and reply.model == model
    (choice,) = reply.choices
    assert choice.text == expected_text(list(b"Hello"), adapter, 7)
    assert choice.finish_reason == "length"
    usage = reply.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (5, 7, 12)


@pytest.mark.parametrize("model, adapter", [("smol", None), ("b", "b")])
def test_completions_stream(deployment, model, adapter):
    chunks = list(
        deployment.client.completions.create(
            model=model,
            prompt=[3, 4, 5],  # token ids
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *tokens, usage_chunk = chunks
    assert len(tokens) == 6  # one chunk per token
    assert "".join(c.choices[0].text for c in tokens) == expected_text([3, 4, 5], adapter, 6)
    assert [c.choices[0].finish_reason for c in tokens] == [None] * 5 + ["length"]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 6
    assert len({c.id for c in chunks}) == 1


@pytest.mark.parametrize("model, adapter", [("smol", None), ("a", "a")])
def test_chat(deployment, model, adapter):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    reply = deployment.client.chat.completions.create(model=model, messages=messages, max_tokens=5)
    assert reply.object == "chat.completion"
    (choice,) = reply.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == expected_text(chat_ids(messages), adapter, 5)
    assert choice.finish_reason == "length"
    assert reply.usage.prompt_tokens == len(chat_ids(messages))


@pytest.mark.parametrize("model, adapter", [("smol", None), ("a", "a")])
def test_chat_stream(deployment, model, adapter):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi there"}]}]
    chunks = list(
        deployment.client.chat.completions.create(
            model=model, messages=messages, max_completion_tokens=4, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    flat = [{"role": "user", "content": "Hi there"}]
    assert text == expected_text(chat_ids(flat), adapter, 4)
    assert chunks[-1].choices[0].finish_reason == "length"


# -- log-probabilities, echo, batches, defaults -------------------------------------------


def mock_entry(anchor: int, chosen: int, count: int) -> tuple[float, dict[str, float]]:
    """The mock's log-probability of `chosen` at a position whose most likely token is
    `anchor`, and its `count` most likely there by text (mock_logprobs)."""
    arrays = mock_logprobs(anchor, [chosen], VOCAB)
    top = {
        TOKENIZER.decode([int(t)]): float(v)
        for t, v in zip(arrays.top_ids[0][:count], arrays.top[0][:count], strict=True)
    }
    return float(arrays.chosen[0]), top


@pytest.mark.parametrize("stream", [False, True])
def test_completions_echo_the_prompt_with_each_tokens_logprobs(deployment, stream):
    """lm-eval's loglikelihood request: echo, logprobs=1, max_tokens=1, token ids."""
    prompt = [5, 9, 12]
    reply = deployment.client.completions.create(
        model="a", prompt=prompt, max_tokens=2, echo=True, logprobs=2, stream=stream
    )
    chunks = list(reply) if stream else [reply]
    text = "".join(chunk.choices[0].text for chunk in chunks)
    tokens, logprobs, tops, offsets = [], [], [], []
    for chunk in chunks:
        part = chunk.choices[0].logprobs
        tokens += part.tokens
        logprobs += part.token_logprobs
        tops += part.top_logprobs
        offsets += part.text_offset
    generated = mock_completion(prompt, "a", 2, VOCAB)
    assert text == TOKENIZER.decode(prompt) + TOKENIZER.decode(generated)
    assert tokens == [TOKENIZER.decode([t]) for t in prompt + generated]
    assert logprobs[0] is None and tops[0] is None
    sequence = prompt + generated
    for i in range(1, len(sequence)):
        anchor = sequence[i] if i >= len(prompt) else sequence[i - 1]
        chosen, top = mock_entry(anchor, sequence[i], 2)
        assert logprobs[i] == pytest.approx(chosen)
        assert tops[i] == {**top, tokens[i]: pytest.approx(chosen)}
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


def test_chat_logprobs_and_top_logprobs(deployment):
    messages = [{"role": "user", "content": "Hi"}]
    reply = deployment.client.chat.completions.create(
        model="smol", messages=messages, max_tokens=3, logprobs=True, top_logprobs=2
    )
    content = reply.choices[0].logprobs.content
    generated = mock_completion(chat_ids(messages), None, 3, VOCAB)
    assert [entry.token for entry in content] == [TOKENIZER.decode([t]) for t in generated]
    for entry, token in zip(content, generated, strict=True):
        chosen, top = mock_entry(token, token, 2)
        assert entry.logprob == pytest.approx(chosen)
        assert entry.bytes == list(entry.token.encode())
        assert {t.token: t.logprob for t in entry.top_logprobs} == pytest.approx(top)
    stream = deployment.client.chat.completions.create(
        model="smol", messages=messages, max_tokens=3, logprobs=True, stream=True
    )
    streamed = [c.choices[0].logprobs.content[0] for c in stream if c.choices[0].logprobs]
    assert [(e.token, e.top_logprobs) for e in streamed] == [(e.token, []) for e in content]


def test_prompt_logprobs_in_vllms_shape(deployment):
    prompt = [5, 9, 12]
    code, reply = deployment.post(
        COMPLETIONS, dict(model="smol", prompt=prompt, max_tokens=1, prompt_logprobs=1)
    )
    assert code == 200, reply
    positions = reply["choices"][0]["prompt_logprobs"]
    assert positions[0] is None and len(positions) == 3
    for i in (1, 2):
        chosen, top = mock_entry(prompt[i - 1], prompt[i], 1)
        (best,) = top
        entry = positions[i][str(prompt[i])]
        assert entry["logprob"] == pytest.approx(chosen)
        assert entry["decoded_token"] == TOKENIZER.decode([prompt[i]])
        assert positions[i][str(prompt[i - 1])]["rank"] == 1  # the mock's most likely
        assert best == TOKENIZER.decode([prompt[i - 1]])


@pytest.mark.parametrize("stream", [False, True])
def test_a_batch_of_prompts_gets_a_choice_each(deployment, stream):
    prompts = ["ab", [7, 8], "xyz"]
    reply = deployment.client.completions.create(
        model="b", prompt=prompts, max_tokens=3, stream=stream
    )
    texts = ["", "", ""]
    for chunk in list(reply) if stream else [reply]:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    ids = [list(p.encode()) if isinstance(p, str) else p for p in prompts]
    assert texts == [expected_text(i, "b", 3) for i in ids]
    if not stream:
        assert reply.usage.prompt_tokens == sum(map(len, ids))
        assert reply.usage.completion_tokens == 9


@pytest.fixture
def placed(deployment, monkeypatch):
    """Each worker's request ids, as they reach its engine."""
    seen: list[list[str]] = [[] for _ in deployment.engines]
    for engine, ids in zip(deployment.engines, seen, strict=True):
        add = engine.add_request

        def recorded(request, *args, add=add, ids=ids, **kwargs):
            ids.append(request.request_id)
            return add(request, *args, **kwargs)

        monkeypatch.setattr(engine, "add_request", recorded)
    return seen


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_n_choices_of_a_prompt_run_on_one_worker(deployment, placed, stream):
    """n=3 over a batch of two prompts: six choices, prompt by prompt, each the mock's
    completion; a prompt's three on one worker (its first's: the prompt is in its prefix
    cache); the prompts counted once each in usage."""
    prompts = ["ab", [7, 8, 9]]
    reply = deployment.client.completions.create(
        model="a", prompt=prompts, max_tokens=3, n=3, stream=stream, seed=5,
        stream_options={"include_usage": True} if stream else None,
    )  # fmt: skip
    texts, usage = [""] * 6, None
    for chunk in list(reply) if stream else [reply]:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    ids = [list(b"ab"), [7, 8, 9]]
    assert texts == [expected_text(ids[i // 3], "a", 3) for i in range(6)]
    assert usage.prompt_tokens == 5 and usage.completion_tokens == 18
    for prompt in range(2):
        choices = {f"-{prompt * 3 + j}" for j in range(3)}
        where = [sum(i[-2:] in choices for i in ids_) for ids_ in placed]
        assert sorted(where) == [0, 3], where


def test_best_of_returns_the_n_most_likely(deployment):
    """best_of=4, n=2: four sampled, two returned (ranked by their tokens' summed
    log-probabilities; the mock's choices are alike), without logprobs unless asked."""
    reply = deployment.client.completions.create(
        model="b", prompt="xy", max_tokens=4, n=2, best_of=4
    )
    assert [c.index for c in reply.choices] == [0, 1]
    assert all(c.text == expected_text(list(b"xy"), "b", 4) and c.logprobs is None
               for c in reply.choices)  # fmt: skip
    assert reply.usage.completion_tokens == 16 and reply.usage.prompt_tokens == 2
    chat = deployment.client.chat.completions.create(
        model="a", messages=[{"role": "user", "content": "Hi"}], max_tokens=2, n=2
    )
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content


def test_ignored_fields_are_accepted_and_chat_runs_to_the_context(deployment):
    """OpenAI's user, metadata and store change nothing; chat without max_tokens runs to
    the end of the context (max_seq_len 64), as vLLM's does."""
    messages = [{"role": "user", "content": "Hi"}]
    code, reply = deployment.post(
        CHAT, dict(model="a", messages=messages, user="u1", metadata={"k": "v"}, store=False)
    )
    assert code == 200, reply
    prompt = len(chat_ids(messages))
    assert reply["usage"]["completion_tokens"] == 64 - prompt
    assert reply["choices"][0]["finish_reason"] == "length"


def test_tools_a_template_cannot_show_are_refused(monkeypatch):
    """Tools with tool_choice "none" go to the worker, whose template must show them: the
    mock's does (the prompt grows by the tools), one that does not is a 400 naming
    `tools`; the workers serve on."""
    from jlora.engine.mock import MockTokenizer

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    body = dict(model="a", messages=USER, tools=tools, tool_choice="none", max_tokens=2)
    deployment = Deployment(max_seq_len=256)
    try:
        code, reply = deployment.post(CHAT, body)
        assert code == 200, reply
        shown = MockTokenizer().apply_chat_template(USER, tools)
        assert reply["usage"]["prompt_tokens"] == len(shown.encode())
        monkeypatch.setattr(MockTokenizer, "renders_tools", False)
        code, reply = deployment.post(CHAT, body)
        assert code == 400 and reply["error"]["param"] == "tools", reply
        assert "shows no tools" in reply["error"]["message"]
        monkeypatch.undo()
        assert deployment.post(CHAT, body)[0] == 200
    finally:
        deployment.close()


def test_models(deployment):
    models = deployment.client.models.list()
    assert [(m.id, m.root) for m in models.data] == [("smol", "smol"), ("a", "smol"), ("b", "smol")]


def test_errors_reach_the_client_as_exceptions(deployment):
    client = deployment.client
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    assert caught.value.body["param"] == "model" and "nope" in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="a", messages=[{"role": "user", "content": "x"}], temperature=-1
        )
    assert caught.value.body["param"] == "temperature"
    stream = client.completions.create(model="a", prompt="x", max_tokens=3, stream=True)
    assert "".join(c.choices[0].text for c in stream) == expected_text([ord("x")], "a", 3)


# -- bad input, raw ------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]

F = {"function": {"name": "f"}}


def tool(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}


BAD_INPUTS = [
    # (route, body, HTTP status, param, what the message must name)
    (COMPLETIONS, dict(model="nope", prompt="x"), 404, "model", "adapter='nope'"),
    (COMPLETIONS, dict(prompt="x"), 400, "model", "model"),
    (COMPLETIONS, dict(model="a", prompt=""), 400, "prompt", "prompt is empty"),
    (COMPLETIONS, dict(model="a"), 400, "prompt", "prompt"),
    (COMPLETIONS, dict(model="a", prompt=["x", 5]), 400, "prompt", "a list of either"),
    (COMPLETIONS, dict(model="a", prompt=[]), 400, "prompt", "prompt is empty"),
    (COMPLETIONS, dict(model="a", prompt=[1, 5000]), 400, "prompt", "prompt_ids[1]"),
    (COMPLETIONS, dict(model="a", prompt="x" * 100), 400, "prompt", "max_seq_len"),
    (COMPLETIONS, dict(model="a", prompt="x", max_tokens=0), 400, "max_tokens", "max_tokens"),
    (COMPLETIONS, dict(model="a", prompt="x", max_tokens=-5), 400, "max_tokens", "max_tokens"),
    (COMPLETIONS, dict(model="a", prompt="x", max_tokens=10**12), 400, "max_tokens", "range"),
    (COMPLETIONS, dict(model="a", prompt="x", max_tokens=1000), 400, "max_tokens", "context"),
    (COMPLETIONS, dict(model="a", prompt="x", max_tokens="9"), 400, "max_tokens", "integer"),
    (COMPLETIONS, dict(model="a", prompt="x", temperature=-0.5), 400, "temperature", "[0, 100]"),
    (COMPLETIONS, dict(model="a", prompt="x", temperature=1e30), 400, "temperature", "[0, 100]"),
    (COMPLETIONS, dict(model="a", prompt="x", top_p=0), 400, "top_p", "(0, 1]"),
    (COMPLETIONS, dict(model="a", prompt="x", top_p=1.5), 400, "top_p", "(0, 1]"),
    (COMPLETIONS, dict(model="a", prompt="x", seed=-1), 400, "seed", "seed"),
    (COMPLETIONS, dict(model="a", prompt="x", stop=5), 400, "stop", "stop"),
    (COMPLETIONS, dict(model="a", prompt="x", n=0), 400, "n", "[1, 128]"),
    (CHAT, dict(model="a", messages=USER, n=129), 400, "n", "[1, 128]"),
    (COMPLETIONS, dict(model="a", prompt="x", n=3, best_of=2), 400, "best_of", "[n=3, 128]"),
    (COMPLETIONS, dict(model="a", prompt="x", best_of=2, stream=True), 400, "best_of",
     "cannot be streamed"),
    (CHAT, dict(model="a", messages=USER, best_of=2), 400, "best_of", "not a field"),
    (COMPLETIONS, dict(model="a", prompt="x", echo="yes"), 400, "echo", "boolean"),
    (COMPLETIONS, dict(model="a", prompt="x", frobnicate_tokens=3), 400, "frobnicate_tokens",
     "not a field"),
    (COMPLETIONS, dict(model="a", prompt="x", suffix="!"), 400, "suffix", "not supported yet"),
    (COMPLETIONS, dict(model="a", prompt="x", repetition_penalty=0), 400,
     "repetition_penalty", "(0, 100]"),
    (COMPLETIONS, dict(model="a", prompt="x", presence_penalty=2.5), 400, "presence_penalty",
     "[-2, 2]"),
    (COMPLETIONS, dict(model="a", prompt="x", frequency_penalty="1"), 400, "frequency_penalty",
     "number"),
    (COMPLETIONS, dict(model="a", prompt="x", min_p=1.5), 400, "min_p", "[0, 1]"),
    (COMPLETIONS, dict(model="a", prompt="x", max_tokens=4, min_tokens=5), 400, "min_tokens",
     "max_tokens=4"),
    (COMPLETIONS, dict(model="a", prompt="x", logit_bias={"x1": 2}), 400, "logit_bias",
     "token ids"),
    (COMPLETIONS, dict(model="a", prompt="x", logit_bias={"5000": 2}), 400, "logit_bias",
     "vocabulary"),
    (COMPLETIONS, dict(model="a", prompt="x", logit_bias={"5": 101}), 400, "logit_bias",
     "[-100, 100]"),
    (COMPLETIONS, dict(model="a", prompt="x", stop_token_ids=[1, -2]), 400, "stop_token_ids",
     "token ids"),
    (COMPLETIONS, dict(model="a", prompt="x", stop_token_ids=[9999]), 400, "stop_token_ids",
     "vocabulary"),
    (COMPLETIONS, dict(model="a", prompt="x", logprobs=21), 400, "logprobs", "[0, 20]"),
    (COMPLETIONS, dict(model="a", prompt="x", prompt_logprobs=-1), 400, "prompt_logprobs",
     "[0, 20]"),
    (CHAT, dict(model="a", messages=USER, top_logprobs=2), 400, "top_logprobs", "logprobs=true"),
    (CHAT, dict(model="a", messages=USER, logprobs=True, top_logprobs=30), 400, "top_logprobs",
     "[0, 20]"),
    (CHAT, dict(model="a", messages=USER, tools=[{"type": "function"}]), 400,
     "tools[0].function", "required"),
    (CHAT, dict(model="a", messages=USER, tools=[{"type": "code", **F}]), 400, "tools[0].type",
     "'function'"),
    (CHAT, dict(model="a", messages=USER, tools=[tool("a b")]), 400, "tools[0].function.name",
     "letters"),
    (CHAT, dict(model="a", messages=USER, tools=[tool("f"), tool("f")]), 400,
     "tools[1].function.name", "another tool"),
    (CHAT, dict(model="a", messages=USER, tool_choice="required"), 400, "tool_choice",
     "needs tools"),
    (CHAT, dict(model="a", messages=USER, tools=[tool("f")], tool_choice="sometimes"), 400,
     "tool_choice", "'required'"),
    (CHAT, dict(model="a", messages=USER, tools=[tool("f")],
                tool_choice={"type": "function", "function": {"name": "g"}}), 400,
     "tool_choice.function.name", "not one of the tools ['f']"),
    (CHAT, dict(model="a", messages=USER, tools=[tool("f")], tool_choice="required",
                response_format={"type": "json_object"}), 400, "tool_choice", "response_format"),
    (CHAT, dict(model="a", messages=USER, tools=[tool("f")]), 400, "tool_choice",
     "--tool-call-parser"),
    (CHAT, dict(model="a", messages=[{"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]), 400,
     "messages[0].tool_calls[0].function.arguments", "JSON object"),
    (CHAT, dict(model="a", messages=[{"role": "user", "content": "x", "tool_calls": []}]), 400,
     "messages[0].tool_calls", "not a field of a 'user' message"),
    (CHAT, dict(model="a", messages=[{"role": "user", "content": "x", "audio": {}}]), 400,
     "messages[0].audio", "not a field"),
    (CHAT, dict(model="a", messages=USER, stream_options={"include_usage": 1}), 400,
     "stream_options.include_usage", "boolean"),
    (COMPLETIONS, dict(model="a", prompt="x", stream="yes"), 400, "stream", "stream"),
    (CHAT, dict(model="a", messages=[]), 400, "messages", "no message"),
    (CHAT, dict(model="a", messages="hi"), 400, "messages", "messages"),
    (CHAT, dict(model="a", messages=[{"role": "robot", "content": "x"}]), 400,
     "messages[0].role", "role"),
    (CHAT, dict(model="a", messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
     400, "messages[0].content[0]", "text"),
    (CHAT, dict(model="a", messages=USER, max_completion_tokens=0), 400, "max_completion_tokens",
     "max_tokens"),
    (CHAT, dict(model="nope", messages=USER), 404, "model", "nope"),
]  # fmt: skip


@pytest.mark.parametrize(
    "route, body, status, param, names",
    BAD_INPUTS,
    ids=[f"{i}-{case[3]}" for i, case in enumerate(BAD_INPUTS)],
)
def test_bad_input_gets_its_status_and_names_the_field(
    deployment, route, body, status, param, names
):
    code, reply = deployment.post(route, body)
    assert code == status, reply
    error = reply["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and names in error["message"]
    assert error["type"] == ("invalid_request_error" if status in (400, 404) else error["type"])
    wait_for(deployment.idle, what="idle")
    ok = deployment.client.completions.create(model="a", prompt="ok", max_tokens=2)
    assert ok.choices[0].text == expected_text(list(b"ok"), "a", 2)


@pytest.mark.parametrize(
    "body",
    [b"{not json", b"", b'{"model": "a", "prompt": "x"', b"\xff\xfe", b"[1, 2]", b'"text"'],
)
def test_malformed_json_is_a_400(deployment, body):
    code, reply = deployment.post(COMPLETIONS, body)
    assert code == 400
    assert "JSON" in reply["error"]["message"]
    assert reply["error"]["type"] == "invalid_request_error"


def test_unknown_routes_answer_in_openai_shape(deployment):
    code, body = deployment.get("/v1/engines")
    assert code == 404 and "error" in json.loads(body)


# -- queue, deadline, availability, disconnects --------------------------------------------


def long_running(deployment: Deployment, count: int) -> list:
    """`count` base-model streams that hold their slots, each past its first token."""
    calls = []
    for i in range(count):
        channel = grpc.insecure_channel(deployment.router.address)
        message = pb.GenerateRequest(adapter="smol")
        message.token_ids.ids.append(i + 1)
        message.sampling.max_tokens = 60
        call = pb_grpc.JloraStub(channel).Generate(message)
        next(call)
        calls.append(call)
    return calls


def test_full_queue_is_429_deadline_is_504_no_worker_is_503():
    deployment = Deployment(max_slots=1, max_queue=0, poll_interval=0.1)
    try:
        for engine in deployment.engines:
            engine.device.step_latency = 0.02
        calls = long_running(deployment, 2)  # both workers' only slots
        code, reply = deployment.post(COMPLETIONS, dict(model="a", prompt="x", max_tokens=2))
        assert code == 429 and reply["error"]["type"] == "rate_limit_error"
        assert "max_queue=0" in reply["error"]["message"]
        with pytest.raises(openai.RateLimitError):
            deployment.client.completions.create(model="a", prompt="x", max_tokens=2)
        for call in calls:
            call.cancel()
        wait_for(deployment.idle, what="idle")
        code, reply = deployment.post(
            COMPLETIONS,
            dict(model="a", prompt="x", max_tokens=50),
            headers={"X-Request-Timeout": "0.2"},
        )
        assert code == 504 and reply["error"]["code"] == "deadline_exceeded"
        wait_for(deployment.idle, what="the worker to abort the request")
        for worker in deployment.workers:
            worker.stop(grace=0)
        wait_for(lambda: not any(w.up for w in deployment.router.workers), what="workers down")
        code, reply = deployment.post(COMPLETIONS, dict(model="a", prompt="x", max_tokens=2))
        assert code == 503 and "no healthy worker" in reply["error"]["message"]
        assert deployment.get("/health")[0] == 503
    finally:
        deployment.close()


def test_a_stream_whose_worker_stops_ends_with_an_error_event():
    deployment = Deployment(poll_interval=0.1)
    try:
        for engine in deployment.engines:
            engine.device.step_latency = 0.01
        stream = deployment.client.completions.create(
            model="a", prompt="x", max_tokens=60, stream=True
        )
        chunks = iter(stream)
        next(chunks)
        for worker in deployment.workers:
            worker.stop(grace=0)  # cancels the streams it runs
        with pytest.raises(openai.APIError) as caught:
            list(chunks)
        assert "failed after" in caught.value.message
        assert caught.value.body["code"] == "worker_lost"
    finally:
        deployment.close()


def test_a_client_that_disconnects_frees_the_worker(deployment):
    engine_steps = [engine.device.steps for engine in deployment.engines]
    for engine in deployment.engines:
        engine.device.step_latency = 0.01
    try:
        stream = deployment.client.completions.create(
            model="a", prompt="x", max_tokens=60, stream=True
        )
        next(iter(stream))
        stream.close()
        wait_for(deployment.idle, timeout=5, what="the request to be aborted")
        steps = sum(e.device.steps for e in deployment.engines) - sum(engine_steps)
        assert steps < 40  # not run to its 60 tokens
    finally:
        for engine in deployment.engines:
            engine.device.step_latency = 0.002


# -- /metrics, /health -----------------------------------------------------------------


def test_metrics_and_health(deployment):
    deployment.client.completions.create(model="b", prompt="m", max_tokens=3)
    code, body = deployment.get("/metrics")
    assert code == 200
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
    }
    assert samples[("jlora_router_time_to_first_token_seconds_count", ())] >= 1
    assert samples[("jlora_router_time_per_output_token_seconds_count", ())] >= 2
    assert samples[("jlora_router_requests_total", (("outcome", "length"),))] >= 1
    assert samples[("jlora_router_queued_requests", ())] == 0
    for worker in deployment.workers:
        label = (("worker", worker.address),)
        assert samples[("jlora_router_worker_up", label)] == 1
        assert ("jlora_router_worker_adapter_loads_total", label) in samples
        assert ("jlora_router_worker_running_requests", label) in samples
    code, body = deployment.get("/health")
    health = json.loads(body)
    assert code == 200 and health["status"] == "ok"
    assert set(health["workers"].values()) == {"up"}
