"""Structured output: the sampler's grammar mask, llguidance's matcher over SmolLM2's
tokenizer, and through `jlora up` with the official openai client: 20 JSON schemas whose
outputs validate (jsonschema), a regex, a choice, a Lark grammar and any JSON object,
whole and streamed, through OpenAI's response_format and vLLM's structured_outputs.
"""

from __future__ import annotations

import json
import re
import sys

import jax
import numpy as np
import pytest

from jlora.device.sampling import host_sampling, sample
from jlora.engine.api import StructuredOutput

sample_jit = jax.jit(lambda logits, params: sample(logits, params)[0])


def _mask(allowed: list[int], vocab: int) -> np.ndarray:
    bits = np.zeros(-(-vocab // 32) * 32, np.uint8)
    bits[allowed] = 1
    return np.packbits(bits, bitorder="little").view(np.int32)


def test_a_constrained_row_samples_only_what_its_grammar_allows():
    """Greedy and sampled rows with a bitmask pick only allowed tokens (the greedy row the
    most likely of them); an unconstrained row beside them is unchanged; ids past the
    bitmask (a mesh's padded vocabulary) are never allowed."""
    vocab, rows = 100, 600
    logits = np.random.default_rng(0).normal(0, 2, (rows, vocab)).astype(np.float32)
    arrays = host_sampling(rows, 0, 96)  # 3 words: ids 96-99 are past the bitmask
    allowed = [3, 17, 40, 95]
    arrays.temperature[1:] = 1.0
    arrays.step[:] = np.arange(rows)
    for row in range(rows - 1):
        arrays.allowed[row] = _mask(allowed, 96)
        arrays.constrained[row] = True
    tokens = np.asarray(sample_jit(logits, arrays))
    assert tokens[0] == allowed[int(np.argmax(logits[0, allowed]))]
    assert set(tokens[1:-1].tolist()) == set(allowed)  # 598 draws reach all four
    free = arrays.replace(
        constrained=np.zeros(rows, bool), allowed=np.full_like(arrays.allowed, -1)
    )
    assert tokens[-1] == np.asarray(sample_jit(logits, free))[-1]


@pytest.mark.slow
def test_the_matcher_walks_a_schema_over_smollm2s_tokens():
    from jlora.engine.grammar import Grammars
    from jlora.model.loading import load_model

    tokenizer = load_model("smollm2-135m").tokenizer
    grammars = Grammars(tokenizer.backend.to_str(), 49152, tokenizer.eos_ids)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}  # fmt: skip
    constraint = StructuredOutput("json_schema", json.dumps(schema))
    matcher = grammars.matcher(constraint)
    for token in tokenizer.encode('{"a": 12}'):
        allowed = np.unpackbits(matcher.mask().view(np.uint8), bitorder="little")
        assert allowed[token] == 1
        matcher.consume(token)
    assert matcher.stopped
    again = grammars.matcher(constraint)  # the cached grammar, a fresh place in it
    assert not again.stopped and np.array_equal(again.mask(), grammars.matcher(constraint).mask())
    from jlora.contract.errors import InvalidRequest, RequestError

    with pytest.raises(InvalidRequest, match="frob") as caught:
        grammars.matcher(StructuredOutput("json_schema", '{"type": "frob"}'))
    assert caught.value.field == "sampling.structured"
    with pytest.raises(RequestError, match="breaks the request's grammar"):
        again.consume(tokenizer.encode("x")[0])


# -- through jlora up ------------------------------------------------------------------


def _object(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required,
            "additionalProperties": False}  # fmt: skip


NAME = {"type": "string", "maxLength": 16}
DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}
SCHEMAS = [
    _object({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    _object({"city": NAME, "country": NAME}),
    _object({"answer": {"type": "boolean"}}),
    _object({"colour": {"enum": ["red", "green", "blue"]}}),
    _object({"score": {"type": "number", "minimum": 0, "maximum": 10}}),
    _object({"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}}),
    _object({"point": _object({"x": {"type": "integer"}, "y": {"type": "integer"}})}),
    _object({"title": NAME, "year": {"type": "integer", "minimum": 1900, "maximum": 2030}}),
    _object({"ok": {"const": True}}),
    _object({"id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}),
    _object({"value": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}),
    _object({"first": NAME, "last": NAME, "email": {"type": "string", "maxLength": 24}}),
    _object({"items": {"type": "array", "maxItems": 2,
                       "items": _object({"name": NAME, "qty": DIGIT})}}),
    _object({"language": {"enum": ["python", "rust", "go"]}, "stars": DIGIT}),
    _object({"celsius": {"type": "number"}, "raining": {"type": "boolean"}}),
    _object({"word": NAME, "letters": {"type": "integer", "maximum": 30}}),
    _object({"note": NAME}, required=[]),
    _object({"a": {"type": "integer"}, "b": {"type": "integer"}, "sum": {"type": "integer"}}),
    _object({"status": {"enum": ["open", "closed"]}, "priority": DIGIT}),
    _object({"matrix": {"type": "array", "maxItems": 2,
                        "items": {"type": "array", "maxItems": 2, "items": {"type": "integer"}}}}),
]  # fmt: skip


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    import openai

    from bench.lib.processes import ServerProcess
    from jlora.cli.up import LISTENING

    process = ServerProcess(
        [sys.executable, "-m", "jlora.cli.main", "up", "--port", "0", "--http-port", "0",
         "--state-dir", str(tmp_path_factory.mktemp("state")), "--warmup", "on-demand",
         "--workers", "1", "--max-seq-len", "512"],
        LISTENING, stdout="inherit", stderr="log", start_timeout_s=600,
    )  # fmt: skip
    client = openai.OpenAI(base_url=process.groups[1], api_key="unused", max_retries=0)
    yield client
    client.close()
    process.stop(120, group=True)


def _chat(client, content: str, **kwargs):
    kwargs.setdefault("max_tokens", 200)
    return client.chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": content}], **kwargs
    )


@pytest.mark.e2e
@pytest.mark.slow
def test_json_schemas_through_the_openai_client(client):
    """20 schemas at once (response_format json_schema): every output validates."""
    import concurrent.futures

    import jsonschema

    def ask(schema: dict):
        form = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
        return _chat(client, "Answer in JSON.", response_format=form)

    with concurrent.futures.ThreadPoolExecutor(len(SCHEMAS)) as pool:
        replies = list(pool.map(ask, SCHEMAS))
    for schema, reply in zip(SCHEMAS, replies, strict=True):
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)


@pytest.mark.e2e
@pytest.mark.slow
def test_regex_choice_grammar_and_json_object(client):
    regex = client.completions.create(
        model="smollm2-135m", prompt="A product code:", max_tokens=20,
        extra_body={"structured_outputs": {"regex": r"[A-Z]{2}-[0-9]{4}"}},
    )  # fmt: skip
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{4}", regex.choices[0].text)
    choice = _chat(
        client, "Is the sky blue?", extra_body={"structured_outputs": {"choice": ["yes", "no"]}}
    )
    assert choice.choices[0].message.content in ("yes", "no")
    lark = 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,3}/'
    grammar = _chat(
        client, "What is 6 times 7?", extra_body={"structured_outputs": {"grammar": lark}}
    )
    assert re.fullmatch(r"The answer is [0-9]{1,3}\.", grammar.choices[0].message.content)
    anything = _chat(
        client, 'Reply with the JSON {"ok": true}.', response_format={"type": "json_object"}
    )
    assert isinstance(json.loads(anything.choices[0].message.content), dict)


@pytest.mark.e2e
@pytest.mark.slow
def test_a_streamed_schema_validates_and_bad_ones_are_400(client):
    import jsonschema
    import openai

    schema = SCHEMAS[0]
    form = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
    stream = _chat(client, "A person, in JSON.", response_format=form, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), schema)
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}
    with pytest.raises(openai.BadRequestError) as caught:
        _chat(client, "x", response_format=bad)
    assert (
        caught.value.body["param"] == "response_format" and "frob" in caught.value.body["message"]
    )
    with pytest.raises(openai.BadRequestError) as caught:
        _chat(client, "x", response_format={"type": "yaml"})
    assert caught.value.body["param"] == "response_format.type"
    with pytest.raises(openai.BadRequestError) as caught:
        _chat(client, "x", extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}})
    assert caught.value.body["param"] == "structured_outputs"
    assert _chat(client, "Say hi.", max_tokens=3).choices[0].message.content  # still serving
