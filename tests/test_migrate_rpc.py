"""The worker's side of request migration: Migrate exports a request and ends its stream
with ABORTED/MIGRATED after its tokens; Generate with `resume` continues it elsewhere with
the tokens it would have had (MockEngine workers, whose streams are known exactly)."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from jlora.api import jlora_pb2 as pb
from jlora.engine.mock import mock_completion, mock_engine
from jlora.server import convert
from tests.engine_helpers import make_engine
from tests.test_server import VOCAB, Worker, request, rich_details, token_ids

Code = grpc.StatusCode


@pytest.fixture
def start():
    workers: list[Worker] = []

    def start_worker(**engine) -> Worker:
        engine.setdefault("adapters", {"a": 8})
        worker = Worker(mock_engine(**engine), max_queue=8)
        workers.append(worker)
        return worker

    yield start_worker
    for worker in workers:
        worker.close()


class Reader:
    """A Generate stream read on its own thread: its responses and how it ended."""

    def __init__(self, worker: Worker, message: pb.GenerateRequest) -> None:
        self.responses: list[pb.GenerateResponse] = []
        self.error: grpc.RpcError | None = None
        self._call = worker.stub.Generate(message, timeout=30)
        self._thread = threading.Thread(target=self._read)
        self._thread.start()

    def _read(self) -> None:
        try:
            for response in self._call:
                self.responses.append(response)
        except grpc.RpcError as err:
            self.error = err

    def wait_tokens(self, count: int) -> None:
        deadline = time.monotonic() + 10
        while len(self.responses) < count:
            assert time.monotonic() < deadline, f"only {len(self.responses)} tokens arrived"
            time.sleep(0.005)

    def join(self) -> None:
        self._thread.join(30)
        assert not self._thread.is_alive()


def resume_message(reply: pb.MigrateResponse, **fields) -> pb.GenerateRequest:
    message = pb.GenerateRequest(
        request_id=reply.request_id, adapter=reply.adapter, sampling=reply.sampling
    )
    message.token_ids.ids.extend(reply.prompt_ids)
    message.resume.generated_ids.extend(reply.generated_ids)
    message.resume.seed = reply.seed
    for name, value in fields.items():
        setattr(message, name, value)
    return message


def test_a_running_request_migrates_and_resumes_with_the_same_tokens(start):
    source = start(step_latency=0.01)
    target = start()
    prompt, total = [3, 1, 4], 30
    expected = mock_completion(prompt, "a", total, VOCAB)
    reader = Reader(source, request(ids=prompt, adapter="a", max_tokens=total, request_id="r1"))
    reader.wait_tokens(5)
    reply = source.stub.Migrate(pb.MigrateRequest(request_id="r1"), timeout=10)
    reader.join()
    # The stream ends with ABORTED / MIGRATED after every token generated before the export.
    assert reader.error is not None and reader.error.code() == Code.ABORTED
    assert rich_details(reader.error) == (None, "MIGRATED")
    moved = len(reply.generated_ids)
    assert reply.running and reply.streamed_tokens == moved == len(reader.responses) >= 5
    assert list(reply.generated_ids) == token_ids(reader.responses) == expected[:moved]
    assert list(reply.prompt_ids) == prompt and reply.adapter == "a"
    assert reply.sampling.max_tokens == total and reply.sampling.seed == reply.seed
    assert source.wait_idle().memory.kv_blocks_free > 0  # its slot and blocks are free
    # Resumed on another worker, it continues with the next token.
    rest = list(target.stub.Generate(resume_message(reply), timeout=10))
    assert token_ids(rest) == expected[moved:]
    assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert (rest[-1].usage.prompt_tokens, rest[-1].usage.completion_tokens) == (3, total)
    memory = target.wait_idle().memory  # no request holds a block any more
    assert memory.kv_blocks_free + memory.cache.pages_lora == memory.kv_blocks_total


def test_a_request_migrates_twice(start):
    first, second = start(step_latency=0.01), start(step_latency=0.01)
    prompt, total = [9, 9], 40
    expected = mock_completion(prompt, None, total, VOCAB)
    reader = Reader(first, request(ids=prompt, max_tokens=total, request_id="twice"))
    reader.wait_tokens(3)
    reply = first.stub.Migrate(pb.MigrateRequest(request_id="twice"), timeout=10)
    reader.join()
    second_leg = Reader(second, resume_message(reply))
    second_leg.wait_tokens(3)
    again = second.stub.Migrate(pb.MigrateRequest(request_id="twice"), timeout=10)
    second_leg.join()
    assert again.streamed_tokens == len(second_leg.responses)
    assert len(again.generated_ids) == len(reader.responses) + len(second_leg.responses)
    last_leg = list(first.stub.Generate(resume_message(again), timeout=10))
    streamed = [*reader.responses, *second_leg.responses, *last_leg]
    assert token_ids(streamed) == expected
    assert last_leg[-1].usage.completion_tokens == total


def test_a_queued_request_migrates_before_its_first_token(start):
    source = start(max_slots=1, step_latency=0.01)
    target = start()
    busy = Reader(source, request(ids=[1], max_tokens=60, request_id="busy"))
    busy.wait_tokens(1)
    queued = Reader(source, request(ids=[5, 6], max_tokens=8, request_id="queued"))
    deadline = time.monotonic() + 5
    while not (waiting := list(source.stats().waiting)):
        assert time.monotonic() < deadline, "the second request never showed as queued"
        time.sleep(0.005)
    [entry] = waiting
    assert (entry.request_id, entry.slot, entry.max_tokens, entry.prompt_tokens) == (
        "queued",
        -1,
        8,
        2,
    )
    assert [r.max_tokens for r in source.stats().running] == [60]
    reply = source.stub.Migrate(pb.MigrateRequest(request_id="queued"), timeout=10)
    queued.join()
    assert not reply.running and list(reply.generated_ids) == [] and queued.responses == []
    assert queued.error is not None and queued.error.code() == Code.ABORTED
    resumed = list(target.stub.Generate(resume_message(reply), timeout=10))
    assert token_ids(resumed) == mock_completion([5, 6], None, 8, VOCAB)
    busy.join()
    assert token_ids(busy.responses) == mock_completion([1], None, 60, VOCAB)


def test_migrate_without_a_stream_is_not_found(start):
    worker = start()
    with pytest.raises(grpc.RpcError) as caught:
        worker.stub.Migrate(pb.MigrateRequest(request_id="nobody"), timeout=5)
    assert caught.value.code() == Code.NOT_FOUND
    assert rich_details(caught.value)[0] == "request_id"
    assert "nobody" in caught.value.details()


def test_the_stats_say_the_kv_bytes_of_a_block_when_the_engine_knows_them(start, tiny):
    assert start().stats().memory.kv_bytes_per_block == 2**16  # the mock's default
    engine = make_engine(tiny, max_slots=2, max_seq_len=64, block_size=16)
    model = tiny.config
    # 16 tokens x (keys, values) x layers x kv heads x head dims x 4 bytes (fp32)
    expected = 16 * 2 * model.num_layers * model.num_kv_heads * model.head_dim * 4
    stats = engine.stats()
    assert convert.stats_message(stats, max_queue=0, draining=False).memory.kv_bytes_per_block
    assert stats.kv_block_bytes == expected
    engine.close()


BAD_RESUMES = [
    # (GenerateRequest fields, the resume's generated ids, what the message names, field)
    (dict(ids=[1, 2]), [1, VOCAB], f"resume.generated_ids[1]={VOCAB}", "resume.generated_ids"),
    (dict(ids=[1, 2]), [-1], "resume.generated_ids[0]=-1", "resume.generated_ids"),
    (dict(ids=[1, 2], max_tokens=3), [1, 2, 3], "max_tokens=3", "resume.generated_ids"),
    (dict(ids=[1] * 60, max_tokens=64), [1] * 4, "max_seq_len", "resume.generated_ids"),
]


@pytest.mark.parametrize(
    "fields, generated, names, field", BAD_RESUMES, ids=[b[2] for b in BAD_RESUMES]
)
def test_a_bad_resume_is_refused_naming_the_field(start, fields, generated, names, field):
    worker = start(max_seq_len=64)
    message = request(**fields)
    message.resume.generated_ids.extend(generated)
    with pytest.raises(grpc.RpcError) as caught:
        list(worker.stub.Generate(message, timeout=5))
    assert caught.value.code() == Code.INVALID_ARGUMENT
    assert names in caught.value.details()
    assert rich_details(caught.value)[0] == field
    worker.wait_idle()


@pytest.mark.parametrize(
    "prompt", [dict(text="hello there"), dict(chat=[("user", "hello there")])], ids=["text", "chat"]
)
def test_a_resume_may_carry_the_prompt_as_first_sent(start, prompt):
    """After a worker failed, the router resumes a request with the caller's own prompt
    (text or chat, not token ids: it has none): the worker encodes it as the first did
    and continues after the generated ids, text included."""
    worker = start()
    whole = list(worker.stub.Generate(request(**prompt, adapter="a", max_tokens=12), timeout=10))
    message = request(**prompt, adapter="a", max_tokens=12)
    message.resume.generated_ids.extend(token_ids(whole)[:5])
    rest = list(worker.stub.Generate(message, timeout=10))
    assert token_ids(rest) == token_ids(whole)[5:]
    assert "".join(r.text for r in whole[:5] + rest) == "".join(r.text for r in whole)
    assert rest[-1].usage.completion_tokens == 12
    assert rest[-1].usage.prompt_tokens == whole[-1].usage.prompt_tokens


def test_a_resume_seed_beyond_32_bits_is_refused(start):
    message = request(ids=[1, 2])
    message.resume.seed = 2**32
    with pytest.raises(grpc.RpcError) as caught:
        list(start().stub.Generate(message, timeout=5))
    assert caught.value.code() == Code.INVALID_ARGUMENT
    assert rich_details(caught.value)[0] == "resume.seed"


def test_a_sampled_request_resumes_with_its_seed(start):
    """temperature > 0: the resumed half equals the unmigrated run's (same seed, same
    steps); the mock's tokens ignore sampling, so this checks the seed travels intact."""
    source, target = start(step_latency=0.01), start()
    message = request(ids=[2, 7], max_tokens=12, temperature=0.8, seed=1234, request_id="s")
    reader = Reader(source, message)
    reader.wait_tokens(2)
    reply = source.stub.Migrate(pb.MigrateRequest(request_id="s"), timeout=10)
    reader.join()
    assert reply.seed == 1234 and reply.sampling.temperature == pytest.approx(0.8)
    rest = list(target.stub.Generate(resume_message(reply), timeout=10))
    assert token_ids(reader.responses) + token_ids(rest) == mock_completion([2, 7], None, 12, VOCAB)
