"""`jlora serve` as a real process on loopback, with the real engine on cpu-tiny: the
tokens equal the in-process engine's, adapters are registered, loaded, listed and
unloaded over gRPC, Stats reports the running batch with ranks, and SIGTERM drains."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from jlora.adapters.peft import make_demo_adapters
from jlora.api import jlora_pb2 as pb
from jlora.api import jlora_pb2_grpc as pb_grpc
from jlora.engine.api import SamplingParams
from tests.engine_helpers import make_engine, run_to_completion

pytestmark = pytest.mark.e2e  # end to end: `make test-e2e`

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [[5, 9, 2, 77, 31], [400, 3, 3, 12, 8, 9, 1, 250]]


@pytest.fixture(scope="module")
def demo(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("adapters")
    paths = make_demo_adapters(tiny.config, out, n=2, ranks=[4, 16], seed=5)
    return out, {path.name: path for path in paths}


@pytest.fixture(scope="module")
def worker(demo, tmp_path_factory):
    """A `jlora serve` process on cpu-tiny with the demo adapters (also under two more
    names, given in vLLM's --lora-modules forms); yields (stub, process)."""
    adapters_dir, paths = demo
    first = paths["demo-00-r4"]
    port_file = tmp_path_factory.mktemp("serve") / "port"
    process = subprocess.Popen(
        [sys.executable, "-m", "jlora.cli.main", "serve", "--model", "cpu-tiny", "--port", "0",
         "--port-file", str(port_file), "--max-seq-len", "64", "--max-slots", "4",
         "--max-loras", "1", "--max-lora-rank", "16", "--adapters-dir", str(adapters_dir),
         "--warmup", "on-demand",
         "--lora-modules", f"org/tiny:v1={first}",
         json.dumps({"name": "json-form", "path": str(first), "base_model_name": "cpu-tiny"})],
        cwd=ROOT, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 300
    while not port_file.exists() or not port_file.read_text().strip():
        assert process.poll() is None, process.stderr.read() if process.stderr else ""
        assert time.monotonic() < deadline, "jlora serve did not start"
        time.sleep(0.1)
    channel = grpc.insecure_channel(f"127.0.0.1:{port_file.read_text().strip()}")
    yield pb_grpc.JloraStub(channel), process
    channel.close()
    if process.poll() is None:
        process.kill()
        process.wait()


def _generate(stub, ids, adapter="", max_tokens=6):
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=ids),
        adapter=adapter,
        sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )
    return list(stub.Generate(request, timeout=120))


def test_tokens_equal_the_in_process_engine(tiny, demo, worker):
    _, adapters = demo
    stub, _ = worker
    names = sorted(adapters)
    engine = make_engine(
        tiny, max_slots=4, max_seq_len=64, min_bucket=16, max_loras=2, max_lora_rank=16
    )
    try:
        for name, path in adapters.items():
            engine.register_adapter(name, str(path))
        rows = [names[0], None, names[1]]
        prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[1]]
        expected = run_to_completion(
            engine, prompts, SamplingParams(max_tokens=6, ignore_eos=True), rows
        )
    finally:
        engine.close()
    results: dict[int, list] = {}

    def call(index):
        results[index] = _generate(worker[0], prompts[index], rows[index] or "")

    threads = [threading.Thread(target=call, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for index, want in enumerate(expected):
        got = results[index]
        assert [r.token_id for r in got] == want["token_ids"]
        assert got[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert got[-1].usage.completion_tokens == 6
    listed = {a.name: a for a in stub.ListAdapters(pb.ListAdaptersRequest()).adapters}
    assert set(listed) == {*adapters, "org/tiny:v1", "json-form"} and listed[names[1]].rank == 16
    # The --lora-modules names serve the same weights as the directory's own name.
    for alias in ("org/tiny:v1", "json-form"):
        assert listed[alias].sha256 == listed[names[0]].sha256
        tokens = [r.token_id for r in _generate(stub, prompts[0], alias)]
        assert tokens == expected[0]["token_ids"]


def test_adapter_lifecycle_and_stats_over_grpc(demo, worker):
    _, adapters = demo
    stub, _ = worker
    name = sorted(adapters)[1]
    stub.LoadAdapter(pb.LoadAdapterRequest(name=name, pin=True))
    deadline = time.monotonic() + 30
    while True:
        listed = {a.name: a for a in stub.ListAdapters(pb.ListAdaptersRequest()).adapters}
        if listed[name].state == pb.ADAPTER_STATE_DEVICE:
            break
        assert time.monotonic() < deadline, "the pinned adapter never landed"
        time.sleep(0.05)
    assert listed[name].pinned
    with pytest.raises(grpc.RpcError) as caught:
        stub.LoadAdapter(pb.LoadAdapterRequest(name="missing"))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert "missing" in caught.value.details()
    # A long generation is running while Stats is read: it reports the row's rank.
    stream = stub.Generate(
        pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=PROMPTS[0]),
            adapter=name,
            sampling=pb.SamplingParams(max_tokens=40, ignore_eos=True),
        ),
        timeout=120,
    )
    next(stream)
    stats = stub.Stats(pb.StatsRequest())
    assert [(r.adapter, r.rank) for r in stats.running] == [(name, 16)]
    stream.cancel()
    stub.UnloadAdapter(pb.UnloadAdapterRequest(name=name))
    deadline = time.monotonic() + 30
    while stub.Stats(pb.StatsRequest()).running:
        assert time.monotonic() < deadline, "the cancelled request kept its slot"
        time.sleep(0.05)
    listed = {a.name: a for a in stub.ListAdapters(pb.ListAdaptersRequest()).adapters}
    assert listed[name].state == pb.ADAPTER_STATE_HOST and not listed[name].pinned


def test_register_checks_the_registrys_sha256_against_the_loaded_bytes(tiny, demo, worker):
    """The router passes the registry's sha256: a worker refuses (DATA_LOSS, nothing
    registered) a file whose bytes differ, and registers it when they match."""
    adapters_dir, _ = demo
    stub, _ = worker
    (path,) = make_demo_adapters(tiny.config, adapters_dir / "late", n=1, ranks=[8], seed=9)
    relative = str(path.relative_to(adapters_dir))
    actual = hashlib.sha256((path / "adapter_model.safetensors").read_bytes()).hexdigest()
    with pytest.raises(grpc.RpcError) as caught:
        stub.RegisterAdapter(pb.RegisterAdapterRequest(name="late", path=relative, sha256="0" * 64))
    assert caught.value.code() == grpc.StatusCode.DATA_LOSS
    assert actual in caught.value.details() and "0" * 64 in caught.value.details()
    names = {a.name for a in stub.ListAdapters(pb.ListAdaptersRequest()).adapters}
    assert "late" not in names
    reply = stub.RegisterAdapter(
        pb.RegisterAdapterRequest(name="late", path=relative, sha256=actual.upper())
    )
    assert reply.adapter.name == "late" and reply.adapter.sha256 == actual


def test_sigterm_drains_and_exits(worker):
    stub, process = worker
    stream = stub.Generate(
        pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=PROMPTS[1]),
            sampling=pb.SamplingParams(max_tokens=30, ignore_eos=True),
        ),
        timeout=120,
    )
    first = next(stream)
    os.kill(process.pid, signal.SIGTERM)
    rest = list(stream)  # the running request finishes during the drain
    assert len([first, *rest]) == 30 and rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert process.wait(timeout=60) == 0
