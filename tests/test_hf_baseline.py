"""The PyTorch baseline server (bench.baselines.hf_server) as the benchmark drives it: a
real subprocess on loopback serving SmolLM2 with two demo PEFT adapters. A mixed batch
(adapter 0, adapter 1, base; prompts of different lengths, so left-padded) must stream,
row by row, exactly what PEFT generates for each request alone; the oracle's prompts
are tokenized and its tokens decoded by jlora's tokenizer, the server's by
transformers', so the two tokenizers are checked against each other too.
"""

from __future__ import annotations

import copy
import json
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from bench.baselines.hf_engine import BASE_ROW
from bench.baselines.hf_server import LISTENING
from bench.lib.processes import ServerProcess
from configs import load_preset
from jlora.adapters.peft import make_demo_adapters

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

MODEL = "smollm2-135m"
ADAPTERS = ["demo-00-r8", "demo-01-r16"]
# (model, prompt): one batch; different prompt lengths (4, 13 and 8 tokens).
REQUESTS = [
    (ADAPTERS[0], "The capital of France is"),
    (ADAPTERS[1], "Once upon a time, in a small village by the sea, there lived"),
    (MODEL, "def fibonacci(n):\n    "),
]
NEW_TOKENS = 16
START_TIMEOUT_S = 300.0


class _Server(ServerProcess):
    """`python -m bench.baselines.hf_server` started at once, its stderr in a file; `url`
    waits for its line on stdout (START_TIMEOUT_S from the first call)."""

    def __init__(self, adapters_dir: Path, log_path: Path) -> None:
        super().__init__(
            [sys.executable, "-m", "bench.baselines.hf_server", "--model", MODEL,
             "--adapters-dir", str(adapters_dir), "--port", "0", "--max-batch", "4",
             "--threads", "1"],
            LISTENING, stdout="log", stderr=log_path, session=False,
            start_timeout_s=START_TIMEOUT_S, wait=False,
        )  # fmt: skip

    def url(self) -> str:
        return self.wait_ready().groups[0]

    def stop(self, timeout: float = 30.0, *, group: bool = False) -> int:
        return super().stop(timeout, group=group)


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    paths = make_demo_adapters(load_preset(MODEL).config, root, n=2, ranks=[8, 16])
    assert [path.name for path in paths] == ADAPTERS
    return root


@pytest.fixture(scope="module")
def server(adapter_dirs, tmp_path_factory):
    """Started first, so that it loads while the test process builds its oracle (one
    torch thread each: two cores)."""
    server = _Server(adapter_dirs, tmp_path_factory.mktemp("hf_server") / "log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tokenizer():
    """jlora's tokenizer, from the same GGUF file."""
    from jlora.model.gguf import GGUFFile
    from jlora.tokenizer import Tokenizer

    return Tokenizer.from_gguf_fields(GGUFFile(load_preset(MODEL).weights.resolve_path()).fields)


@pytest.fixture(scope="module")
def alone(server, adapter_dirs, hf_smollm2, tokenizer):
    """(model, prompt) -> the token ids PEFT generates for that request alone, for every
    request and for the adapters' prompts on the base model."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(
        copy.deepcopy(hf_smollm2), str(adapter_dirs / ADAPTERS[0]), adapter_name=ADAPTERS[0]
    )
    model.load_adapter(str(adapter_dirs / ADAPTERS[1]), adapter_name=ADAPTERS[1])
    model.eval()
    cases = REQUESTS + [(MODEL, prompt) for name, prompt in REQUESTS if name != MODEL]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the server loads on the other core meanwhile
    try:
        return {case: _generate_alone(model, tokenizer, *case) for case in cases}
    finally:
        torch.set_num_threads(threads)


def _generate_alone(model, tokenizer, name: str, prompt: str) -> list[int]:
    ids = torch.tensor([tokenizer.encode(prompt)])
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            adapter_names=[name if name != MODEL else BASE_ROW],
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
        )
    generated = out[0, ids.shape[1] :].tolist()
    assert len(generated) == NEW_TOKENS  # EOS did not end it
    return generated


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


def _stream(
    url: str, model: str, prompt: str, max_tokens: int, started: threading.Event | None = None
) -> tuple[list[str], dict]:
    """bench.serve's request; (each chunk's text, the usage chunk's usage). `started` is
    set at the first chunk."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    request = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    texts, usage, finish = [], None, []
    with urllib.request.urlopen(request, timeout=120) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line:
                continue
            assert line.startswith("data: "), line
            if line == "data: [DONE]":
                break
            chunk = json.loads(line.removeprefix("data: "))
            if started is not None:
                started.set()
            if chunk["choices"]:
                texts.append(chunk["choices"][0]["text"])
                finish.append(chunk["choices"][0]["finish_reason"])
            else:
                usage = chunk["usage"]
    assert finish == [None] * (len(finish) - 1) + ["length"]
    return texts, usage


def _health(url: str) -> dict:
    with urllib.request.urlopen(url + "/health", timeout=10) as response:
        return json.load(response)


def test_a_mixed_batch_streams_what_peft_generates_alone(server, alone, tokenizer):
    url = server.url()
    for name, prompt in REQUESTS:
        if name != MODEL:
            assert alone[name, prompt] != alone[MODEL, prompt], f"{name} changes nothing"
    before = _health(url)
    results: dict[int, tuple[list[str], dict]] = {}

    def call(index: int, model: str, prompt: str, max_tokens: int, started=None) -> None:
        results[index] = _stream(url, model, prompt, max_tokens, started)

    # A first request holds the torch thread while the three queue for the next batch.
    started = threading.Event()
    threads = [threading.Thread(target=call, args=(-1, MODEL, "Hello", NEW_TOKENS, started))]
    threads[0].start()
    assert started.wait(120)
    threads += [
        threading.Thread(target=call, args=(i, name, prompt, NEW_TOKENS))
        for i, (name, prompt) in enumerate(REQUESTS)
    ]
    for thread in threads[1:]:
        thread.start()
    for thread in threads:
        thread.join()

    after = _health(url)
    assert after["batches"] - before["batches"] == 2
    assert after["requests"] - before["requests"] == 4
    for index, (name, prompt) in enumerate(REQUESTS):
        texts, usage = results[index]
        expected = alone[name, prompt]
        assert len(texts) == NEW_TOKENS  # one chunk per token
        assert "".join(texts) == tokenizer.decode(expected), (name, prompt)
        prompt_tokens = len(tokenizer.encode(prompt))
        assert usage == {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": NEW_TOKENS,
            "total_tokens": prompt_tokens + NEW_TOKENS,
        }


def test_models_and_request_errors(server, alone, tokenizer):
    url = server.url()
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as response:
        models = json.load(response)
    assert [(m["id"], m["parent"]) for m in models["data"]] == [
        (MODEL, None),
        (ADAPTERS[0], MODEL),
        (ADAPTERS[1], MODEL),
    ]

    name, prompt = REQUESTS[0]
    status, answer = _post(url, {"model": name, "prompt": prompt, "max_tokens": NEW_TOKENS})
    assert status == 200
    assert answer["choices"][0]["text"] == tokenizer.decode(alone[name, prompt])
    assert answer["choices"][0]["finish_reason"] == "length"

    status, answer = _post(url, {"model": "no-such-adapter", "prompt": prompt})
    assert status == 404
    assert answer["error"]["param"] == "model"
    assert answer["error"]["code"] == "model_not_found"
    assert "no-such-adapter" in answer["error"]["message"]
    for max_tokens in (0, "8", 10**6):
        status, answer = _post(url, {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens})
        assert status == 400, max_tokens
        assert answer["error"]["param"] == "max_tokens"
        assert answer["error"]["type"] == "invalid_request_error"


def test_seeded_sampling_and_stop_strings(server, alone, tokenizer):
    url = server.url()
    name, prompt = REQUESTS[0]
    body = {"model": name, "prompt": prompt, "max_tokens": 8, "temperature": 1.5}
    texts = [_post(url, {**body, "seed": seed})[1]["choices"][0]["text"] for seed in (7, 7, 8)]
    assert texts[0] == texts[1] != texts[2]

    full = tokenizer.decode(alone[name, prompt])
    assert "." in full
    status, answer = _post(url, {"model": name, "prompt": prompt, "stop": ".", "max_tokens": 16})
    assert status == 200
    assert answer["choices"][0]["text"] == full[: full.index(".")]
    assert answer["choices"][0]["finish_reason"] == "stop"
