"""The `jlora` command as a user runs it: a subprocess, stdout for text, stderr for the rest.

Bad input exits with status 2, prints nothing on stdout and names the problem on
stderr. The fast cases fail before any real model is loaded; the slow ones load
SmolLM2 in a fresh process (~10 s each), so there are few of them. All the runs share
one XLA compilation cache in a temporary directory, so later runs skip compiling.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

_SCRIPT = Path(sys.executable).with_name("jlora")
JLORA = [str(_SCRIPT)] if _SCRIPT.is_file() else [sys.executable, "-m", "jlora.cli.main"]


@pytest.fixture(scope="module")
def cli_env(tmp_path_factory) -> dict[str, str]:
    return dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        JLORA_COMPILATION_CACHE=str(tmp_path_factory.mktemp("xla-cache")),
    )


def _jlora(
    env: dict[str, str],
    *args: str,
    cwd: Path,
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*JLORA, *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _assert_usage_error(result: subprocess.CompletedProcess[str], fragments: list[str]) -> None:
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert "Traceback" not in result.stderr, result.stderr
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith(("jlora: error: ", "jlora generate: error: ")), result.stderr
    for fragment in fragments:
        assert fragment in last_line, result.stderr


# -- bad input -------------------------------------------------------------------------

# (id, arguments after `generate`, fragments of the error line). "{tmp}" is a per-test
# directory holding blank.txt (only blank lines) and broken.gguf (plain text).
FAST_BAD_INPUT = [
    ("temperature-negative", ["--prompt", "hi", "--temperature", "-1"], ["temperature=-1.0"]),
    ("temperature-nan", ["--prompt", "hi", "--temperature", "nan"], ["temperature=nan"]),
    ("top-p-zero", ["--prompt", "hi", "--top-p", "0"], ["top_p=0.0", "(0, 1]"]),
    ("top-p-above-one", ["--prompt", "hi", "--top-p", "1.5"], ["top_p=1.5", "(0, 1]"]),
    ("max-tokens-zero", ["--prompt", "hi", "--max-tokens", "0"], ["max_tokens=0"]),
    ("top-k-negative", ["--prompt", "hi", "--top-k", "-3"], ["top_k=-3"]),
    ("seed-negative", ["--prompt", "hi", "--seed", "-1"], ["seed=-1"]),
    (
        "max-tokens-not-a-number",
        ["--prompt", "hi", "--max-tokens", "many"],
        ["--max-tokens", "'many'"],
    ),
    (
        "prompt-and-prompts-file",
        ["--prompt", "hi", "--prompts-file", "{tmp}/blank.txt"],
        ["--prompts-file", "--prompt"],
    ),
    (
        "unknown-model",
        ["--prompt", "hi", "--model", "no-such-preset"],
        ["'no-such-preset'", "presets:", "smollm2-135m"],
    ),
    (
        "model-without-tokenizer",
        ["--prompt", "hi", "--model", "cpu-tiny"],
        ["--model cpu-tiny", "no tokenizer"],
    ),
    (
        "malformed-gguf",
        ["--prompt", "hi", "--model", "{tmp}/broken.gguf"],
        ["broken.gguf", "not a valid GGUF file"],
    ),
    (
        "missing-prompts-file",
        ["--prompts-file", "{tmp}/missing.txt"],
        ["--prompts-file", "missing.txt", "no such file"],
    ),
    (
        "blank-prompts-file",
        ["--prompts-file", "{tmp}/blank.txt"],
        ["--prompts-file", "blank.txt", "no prompts"],
    ),
    (
        "max-seq-len-too-small",
        ["--prompt", "hi", "--max-seq-len", "10"],
        ["--max-seq-len 10", "at least 16"],
    ),
    ("max-slots-zero", ["--prompt", "hi", "--max-slots", "0"], ["--max-slots 0", "at least 1"]),
    ("max-loras-zero", ["--prompt", "hi", "--max-loras", "0"], ["--max-loras 0", "at least 1"]),
    (
        "adapter-missing",
        ["--prompt", "hi", "--adapter", "{tmp}/no-adapter"],
        ["--adapter", "no-adapter", "no such adapter directory"],
    ),
    (
        "adapter-escapes-its-dir",
        ["--prompt", "hi", "--adapters-dir", "{tmp}/adapters", "--adapter", "../secrets"],
        ["--adapter='../secrets'", "must not contain '..'"],
    ),
    (
        "adapter-config-malformed",
        ["--prompt", "hi", "--adapter", "{tmp}/broken-adapter"],
        ["adapter_config.json"],
    ),
    (
        "jsonl-line-not-json",
        ["--prompts-file", "{tmp}/bad.jsonl"],
        ["bad.jsonl line 2", "not valid JSON"],
    ),
    (
        "jsonl-adapter-not-a-string",
        ["--prompts-file", "{tmp}/bad-adapter.jsonl"],
        ["bad-adapter.jsonl line 1", "adapter=5"],
    ),
    (
        "jsonl-unknown-field",
        ["--prompts-file", "{tmp}/bad-field.jsonl"],
        ["bad-field.jsonl line 1", "unknown fields ['lora']"],
    ),
    (
        "lora-backend-unknown",
        ["--prompt", "Hi", "--lora-backend", "punica"],
        ["--lora-backend", "invalid choice: 'punica'"],
    ),
]
SLOW_BAD_INPUT = [
    (
        "prompt-over-context",
        ["--prompt", "word " * 100, "--max-seq-len", "32"],
        ["prompt has", "context limit is 32 tokens"],
    ),
]


@pytest.mark.parametrize(
    ("args", "fragments"),
    [pytest.param(args, fragments, id=name) for name, args, fragments in FAST_BAD_INPUT]
    + [
        pytest.param(args, fragments, id=name, marks=pytest.mark.slow)
        for name, args, fragments in SLOW_BAD_INPUT
    ],
)
def test_bad_input_exits_2_and_names_the_problem(tmp_path, cli_env, args, fragments):
    (tmp_path / "blank.txt").write_text("\n   \n\n")
    (tmp_path / "broken.gguf").write_bytes(b"this is not a GGUF file\n" * 200)
    (tmp_path / "broken-adapter").mkdir()
    (tmp_path / "broken-adapter" / "adapter_config.json").write_text("{not json")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "hi"}\n{"prompt": \n')
    (tmp_path / "bad-adapter.jsonl").write_text('{"prompt": "hi", "adapter": 5}\n')
    (tmp_path / "bad-field.jsonl").write_text('{"prompt": "hi", "lora": "x"}\n')
    args = [arg.replace("{tmp}", str(tmp_path)) for arg in args]
    _assert_usage_error(_jlora(cli_env, "generate", *args, cwd=tmp_path), fragments)


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--lora-modules", "no-equals-sign"], ["--lora-modules 'no-equals-sign'", "NAME=PATH"]),
        (["--lora-modules", "=path"], ["--lora-modules '=path'", "NAME=PATH"]),
        (["--lora-modules", '{"name": "x"'], ["--lora-modules", "not valid JSON"]),
        (["--lora-modules", '{"name": "x", "lora": "p"}'], ["--lora-modules", "string name"]),
        (["--adapter", "x"], ["--adapter 'x'", "NAME=PATH"]),
    ],
)
def test_serve_refuses_bad_adapter_flags(tmp_path, cli_env, args, fragments):
    _assert_usage_error(
        _jlora(cli_env, "serve", "--model", "cpu-tiny", *args, cwd=tmp_path), fragments
    )


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--sharding", "tp4"], ["sharding 'tp4'", "needs 4 devices, 1 are present"]),
        (["--sharding", "nope"], ["unknown sharding preset 'nope'", "tp1, tp2"]),
        (["--num-processes", "2"], ["--num-processes 2", "needs --coordinator HOST:PORT"]),
        (["--num-processes", "2", "--coordinator", "host"], ["--coordinator 'host'", "HOST:PORT"]),
        (["--num-processes", "2", "--process-id", "2"], ["--process-id 2", "process id <"]),
        (
            ["--num-processes", "2", "--coordinator", "127.0.0.1:1", "--lora-mode", "auto"],
            ["--lora-mode auto", "not offered across processes"],
        ),
    ],
)
def test_serve_refuses_bad_sharding_flags(tmp_path, cli_env, args, fragments):
    _assert_usage_error(
        _jlora(cli_env, "serve", "--model", "cpu-tiny", *args, cwd=tmp_path), fragments
    )


# -- generation ------------------------------------------------------------------------

PROMPTS = [
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Hi",
    "The three primary colors are",
]


def _run_jsonl(env: dict[str, str], directory: Path, prompts: list[str]) -> list[dict]:
    prompts_file = directory / "prompts.txt"
    prompts_file.write_text("\n".join(prompts) + "\n")
    result = _jlora(
        env,
        "generate",
        "--prompts-file",
        str(prompts_file),
        "--output",
        "jsonl",
        "--max-tokens",
        "8",
        "--max-seq-len",
        "256",
        "--max-slots",
        "4",
        cwd=directory,
    )
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


@pytest.mark.slow
def test_prompts_file_jsonl_is_in_input_order_and_independent_of_it(tmp_path, cli_env, smollm2):
    forward = _run_jsonl(cli_env, tmp_path, PROMPTS)

    assert [row["prompt"] for row in forward] == PROMPTS
    for row in forward:
        fields = {"prompt", "adapter", "text", "token_ids", "finish_reason", "cached_tokens"}
        assert set(row) == fields
        assert row["adapter"] is None
        assert 0 <= row["cached_tokens"] < len(smollm2.tokenizer.encode(row["prompt"])) + 32
        assert 1 <= len(row["token_ids"]) <= 8
        assert all(isinstance(token, int) for token in row["token_ids"])
        assert row["finish_reason"] in ("stop", "length")
        assert (row["finish_reason"] == "length") == (len(row["token_ids"]) == 8), row
        # The streamed pieces join into the decoding of the whole completion.
        assert row["text"] == smollm2.tokenizer.decode(row["token_ids"]), row
    assert any(row["text"].strip() for row in forward)

    # Greedy decoding: each completion depends on its prompt alone, not on which
    # slot or batch position the prompt got.
    # (What the prefix cache serves depends on the order: the chat template is shared.)
    backward = _run_jsonl(cli_env, tmp_path, PROMPTS[::-1])
    for row in (*forward, *backward):
        del row["cached_tokens"]
    assert backward[::-1] == forward


@pytest.mark.slow
def test_one_batch_mixes_adapters_from_a_jsonl_prompts_file(tmp_path, cli_env, smollm2):
    from jlora.adapters.peft import make_demo_adapters
    from jlora.engine.api import SamplingParams
    from tests.engine_helpers import make_engine, run_to_completion

    make_demo_adapters(smollm2.config, tmp_path / "adapters", n=2, ranks=[8, 16])
    prompt = "The capital of France is"
    rows = [
        {"prompt": prompt, "adapter": "demo-00-r8"},
        {"prompt": prompt, "adapter": None},
        {"prompt": prompt},  # --adapter applies
    ]
    (tmp_path / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    default = str(tmp_path / "adapters" / "demo-01-r16")
    outputs = {}
    # The cached run also takes the MBGMV backend (its kernels interpreted on CPU).
    for mode, backend in (("ondemand", "reference"), ("cached", "mbgmv")):
        result = _jlora(
            cli_env,
            "generate",
            "--prompts-file",
            "mixed.jsonl",
            "--adapters-dir",
            "adapters",
            "--adapter",
            default,
            "--lora-mode",
            mode,
            "--lora-backend",
            backend,
            "--output",
            "jsonl",
            "--max-tokens",
            "12",
            "--ignore-eos",
            cwd=tmp_path,
        )
        assert result.returncode == 0, result.stderr
        outputs[mode] = [json.loads(line) for line in result.stdout.splitlines()]
    assert outputs["ondemand"] == outputs["cached"]
    named, base, defaulted = outputs["ondemand"]
    assert [named["adapter"], base["adapter"], defaulted["adapter"]] == [
        "demo-00-r8",
        None,
        default,
    ]
    engine = make_engine(smollm2, max_slots=1, max_seq_len=64)
    [alone] = run_to_completion(
        engine,
        [smollm2.tokenizer.encode(prompt)],
        SamplingParams(max_tokens=12, ignore_eos=True),
    )
    assert base["token_ids"] == alone["token_ids"]
    assert len({tuple(r["token_ids"]) for r in (named, base, defaulted)}) == 3


@pytest.mark.slow
def test_chat_answer_alone_on_stdout(tmp_path, cli_env):
    result = _jlora(
        cli_env,
        "-v",
        "generate",
        "--chat",
        "--max-tokens",
        "32",
        "--prompt",
        "What is the capital of France?",
        cwd=tmp_path,
    )

    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert " INFO " in result.stderr  # -v logs go to stderr ...
    assert " INFO " not in result.stdout and "jlora" not in result.stdout  # ... not stdout
    assert result.stdout.endswith("\n") and result.stdout.count("\n") <= 2, result.stdout
    assert "<|im_start|>" not in result.stdout and "<|im_end|>" not in result.stdout


# -- help ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--help"], ["usage: jlora", "generate", "convert", "--verbose"]),
        (
            ["generate", "--help"],
            [
                "usage: jlora generate",
                "--prompts-file",
                "--temperature",
                "--top-p",
                "--max-tokens",
                "--chat",
                "--model",
            ],
        ),
        (["convert", "--help"], ["usage: jlora convert", "--out", "--model", "--dtype"]),
    ],
    ids=["jlora", "generate", "convert"],
)
def test_help_exits_0(tmp_path, cli_env, args, expected):
    result = _jlora(cli_env, *args, cwd=tmp_path, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    for fragment in expected:
        assert fragment in result.stdout


def test_profile_writes_a_profile_the_router_loads(tmp_path, cli_env):
    """`jlora profile` on cpu-tiny: both models fitted over every profiled batch, printed
    with R², and saved in the format `router.perf_model.PerfProfile.load` reads."""
    from router.perf_model import PerfProfile

    out = tmp_path / "profile.json"
    result = _jlora(
        cli_env, "profile", "--model", "cpu-tiny", "--out", str(out), "--batches", "1,3",
        "--ranks", "4,16", "--prompt-lens", "16,32", "--repeats", "2",
        "--lora-backend", "mbgmv", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    profile = PerfProfile.load(out)
    assert profile.decode.kind == profile.prefill.kind == "mbgmv"
    assert profile.decode.n_samples == 2 * 3  # 2 sizes x (2 uniform ranks + 1 mix)
    assert profile.prefill.n_samples == 2 * 2  # 2 lengths x 2 ranks
    assert "R² =" in result.stdout and profile.base_model == "cpu-tiny"
