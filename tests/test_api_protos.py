"""The jlora.v1 API: the committed stubs match the .proto, and the .proto keeps its rules."""

from __future__ import annotations

import re

import pytest
from google.protobuf import descriptor

from jlora.api import SERVICE_NAME, jlora_pb2, jlora_pb2_grpc, protoc

PROTO = protoc.PROTO_ROOT / "jlora" / "v1" / "jlora.proto"


def test_committed_stubs_are_regenerated_from_the_proto(tmp_path):
    pytest.importorskip("grpc_tools")
    written = protoc.generate(tmp_path)
    assert sorted(p.name for p in written) == sorted(
        p.name for p in protoc.GEN_DIR.iterdir() if p.is_file() and p.suffix in (".py", ".pyi")
    )
    for fresh in written:
        committed = protoc.GEN_DIR / fresh.name
        assert fresh.read_text() == committed.read_text(), f"run `make protos`: {committed}"


def test_stubs_import_as_a_package_under_their_proto_path():
    source = (protoc.GEN_DIR / "jlora_pb2_grpc.py").read_text()
    assert "from jlora.api.gen import jlora_pb2" in source
    assert jlora_pb2.DESCRIPTOR.package == "jlora.v1"
    assert jlora_pb2.DESCRIPTOR.name == "jlora/v1/jlora.proto"  # what reflection reports


def test_the_service_and_its_streaming_shape():
    service = jlora_pb2.DESCRIPTOR.services_by_name["Jlora"]
    assert service.full_name == SERVICE_NAME == "jlora.v1.Jlora"
    streaming = {m.name: (m.client_streaming, m.server_streaming) for m in service.methods}
    assert streaming.pop("Generate") == (False, True)
    assert set(streaming) == {
        "RegisterAdapter",
        "LoadAdapter",
        "UnloadAdapter",
        "UnregisterAdapter",
        "ListAdapters",
        "Stats",
        "Models",
        "Migrate",
    }
    assert set(streaming.values()) == {(False, False)}
    assert hasattr(jlora_pb2_grpc, "JloraStub") and hasattr(jlora_pb2_grpc, "JloraServicer")


def test_the_proto_carries_its_notice():
    text = PROTO.read_text()
    assert "NOTICE" in text and "make protos" in text
    assert re.search(r"^package jlora\.v1;$", text, re.MULTILINE)


def _message_bodies(text: str) -> dict[str, str]:
    """Top-level message name -> its body (the proto nests no messages)."""
    return dict(re.findall(r"^message (\w+) \{\n(.*?)^\}", text, re.MULTILINE | re.DOTALL))


def test_every_message_states_its_next_id_correctly():
    bodies = _message_bodies(PROTO.read_text())
    assert set(bodies) == set(jlora_pb2.DESCRIPTOR.message_types_by_name)
    for name, body in bodies.items():
        stated = re.findall(r"// Next ID: (\d+)", body)
        assert len(stated) == 1, f"{name}: one `// Next ID:` comment"
        message = jlora_pb2.DESCRIPTOR.message_types_by_name[name]
        reserved = [int(n) for n in re.findall(r"reserved (\d+);", body)]
        used = [f.number for f in message.fields] + reserved
        assert int(stated[0]) == max(used, default=0) + 1, name


def test_retired_fields_stay_reserved():
    body = _message_bodies(PROTO.read_text())["GenerateRequest"]
    assert 'reserved "stream";' in body and "reserved 7;" in body
    assert "stream" not in jlora_pb2.GenerateRequest.DESCRIPTOR.fields_by_name


def test_sampling_fields_have_presence_so_unset_differs_from_zero():
    params = jlora_pb2.SamplingParams()
    for field in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
        assert not params.HasField(field)
    params.top_p = 0.0
    assert params.HasField("top_p")
    fields = jlora_pb2.SamplingParams.DESCRIPTOR.fields_by_name
    assert fields["temperature"].type == descriptor.FieldDescriptor.TYPE_DOUBLE


def test_a_generate_exchange_round_trips():
    request = jlora_pb2.GenerateRequest(
        request_id="r1",
        token_ids=jlora_pb2.TokenIds(ids=[1, 2, 3]),
        adapter="my-lora",
        sampling=jlora_pb2.SamplingParams(max_tokens=8, temperature=0.7, stop=["\n"]),
    )
    assert request.WhichOneof("prompt") == "token_ids"
    request.text = "hello"  # the prompt is one of text, token_ids, chat
    assert request.WhichOneof("prompt") == "text" and not request.HasField("token_ids")
    parsed = jlora_pb2.GenerateRequest.FromString(request.SerializeToString())
    assert parsed == request and parsed.sampling.temperature == 0.7
    last = jlora_pb2.GenerateResponse(
        request_id="r1",
        token_id=42,
        text=" world",
        timing=jlora_pb2.TokenTiming(since_arrival_us=1500, since_previous_us=300),
        finish_reason=jlora_pb2.FINISH_REASON_LENGTH,
        usage=jlora_pb2.Usage(prompt_tokens=1, completion_tokens=8),
    )
    assert jlora_pb2.GenerateResponse.FromString(last.SerializeToString()) == last
    assert jlora_pb2.FinishReason.Name(0) == "FINISH_REASON_UNSPECIFIED"
