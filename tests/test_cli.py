"""The `jlora` command as a user runs it: a subprocess, stdout for text, stderr for the rest.

Bad input exits with status 2, prints nothing on stdout and names the problem on
stderr. The fast cases fail before any real model is loaded; the slow ones load
SmolLM2 in a fresh process (~10 s each), so there are few of them. All the runs share
one XLA compilation cache in a temporary directory, so later runs skip compiling.

The per-line settings of a *.jsonl prompts file are checked in this process instead:
`generate.run` on parsed arguments, with the model's loading replaced by the mock
engine (or cpu-tiny, for seeded sampling) and the mock tokenizer.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jlora.cli import generate, profile, up
from jlora.cli.common import UsageError
from jlora.cli.main import build_parser
from jlora.engine.api import SamplingParams
from jlora.engine.mock import MockTokenizer, mock_completion, mock_engine

pytestmark = pytest.mark.e2e  # end to end: `make test-e2e`

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
        ["bad-field.jsonl line 1", "unknown fields ['lora']", "adapter, max_tokens"],
    ),
    (
        "jsonl-max-tokens-negative",
        ["--prompts-file", "{tmp}/bad-max-tokens.jsonl"],
        ["bad-max-tokens.jsonl line 2: max_tokens=-1 must be a positive integer"],
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
    (tmp_path / "bad-max-tokens.jsonl").write_text(
        '{"prompt": "hi"}\n{"prompt": "hi", "max_tokens": -1}\n'
    )
    args = [arg.replace("{tmp}", str(tmp_path)) for arg in args]
    _assert_usage_error(_jlora(cli_env, "generate", *args, cwd=tmp_path), fragments)


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--prompt", "hi", "--temperature", "-1"],
        ["serve", "--model", "cpu-tiny", "--adapter", "x"],
        ["profile", "--model", "cpu-tiny", "--out", "p.json", "--repeats", "0"],
        ["convert", "--model", "cpu-tiny", "--out", "not-a-dir"],
    ],
    ids=["generate", "serve", "profile", "convert"],
)
def test_a_bad_flag_fails_before_jax_is_imported(tmp_path, argv):
    """Each command checks its flags before it imports JAX and the engine (0.7 s), and
    the error handler looks WeightsError up rather than import it."""
    (tmp_path / "not-a-dir").write_text("")
    code = "import sys; from jlora.cli.main import main; rc = main(sys.argv[1:]); "
    code += "print(rc, 'jax' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code, *argv], cwd=tmp_path, capture_output=True, text=True
    )
    assert result.stdout.split() == ["2", "False"], result.stderr
    assert "error: " in result.stderr


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
        (["--sharding", "tp4"], ["sharding 'tp4'", "needs 4 devices, only 1 is present"]),
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


@pytest.mark.parametrize(
    "command", [["generate"], ["serve"], ["up"], ["profile", "--out", "p.json"]]
)
def test_the_layer_loop_flag_parses_and_refuses_a_bad_value(command, capsys):
    parser = build_parser()
    assert parser.parse_args(command).layer_loop == "auto"
    assert parser.parse_args([*command, "--layer-loop", "unrolled"]).layer_loop == "unrolled"
    with pytest.raises(SystemExit) as exited:
        parser.parse_args([*command, "--layer-loop", "rolled"])
    assert exited.value.code == 2
    assert "--layer-loop: invalid choice: 'rolled'" in capsys.readouterr().err


def test_up_passes_the_layer_loop_to_its_workers(tmp_path):
    parser = build_parser()
    args = parser.parse_args(["up", "--state-dir", str(tmp_path), "--layer-loop", "scan"])
    worker = parser.parse_args(up._worker_command(args, None, 50099)[3:])
    assert worker.layer_loop == "scan"


@pytest.mark.parametrize("command", ["serve", "up"])
def test_the_warmup_flag_parses_refuses_a_bad_value_and_reaches_up_s_workers(
    command, tmp_path, capsys
):
    parser = build_parser()
    assert parser.parse_args([command]).warmup == "ahead"
    args = parser.parse_args([command, "--warmup", "on-demand"])
    assert args.warmup == "on-demand"
    if command == "up":
        args.state_dir = tmp_path
        assert parser.parse_args(up._worker_command(args, None, 50099)[3:]).warmup == "on-demand"
    with pytest.raises(SystemExit) as exited:
        parser.parse_args([command, "--warmup", "eager"])
    assert exited.value.code == 2
    assert "--warmup: invalid choice: 'eager'" in capsys.readouterr().err


# -- per-line settings in a prompts file (in this process) ----------------------------

MOCK_VOCAB = 1000  # MockEngine's default


@pytest.fixture
def generate_jsonl(tmp_path, monkeypatch, capsys):
    """`jlora generate --prompts-file P.jsonl --output jsonl FLAGS` for `rows` (P's lines),
    with `make_engine(slots)` in place of the model's engine and MockTokenizer's encoding
    (a prompt's UTF-8 bytes); returns the exit status and the output rows."""

    def run(make_engine, rows: list[dict], *flags: str) -> tuple[int, list[dict]]:
        path = tmp_path / "prompts.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        encode = MockTokenizer().encode
        monkeypatch.setattr(generate, "_load", lambda args, adapters: (make_engine, encode))
        argv = ["generate", "--prompts-file", str(path), "--output", "jsonl", *flags]
        status = generate.run(build_parser().parse_args(argv))
        return status, [json.loads(line) for line in capsys.readouterr().out.splitlines()]

    return run


def test_prompts_file_lines_carry_their_own_sampling(monkeypatch, generate_jsonl):
    """Every request reaches the engine with its line's settings; a missing (or null) key
    takes its flag's value, and a line's stop replaces the --stop strings."""
    requests = []

    def make_engine(slots):
        engine = mock_engine(max_slots=slots)
        add_request = engine.add_request

        def record(request):
            requests.append(request)
            add_request(request)

        monkeypatch.setattr(engine, "add_request", record)
        return engine

    own = {"max_tokens": 2, "temperature": 1, "top_p": 0.5, "top_k": 0, "seed": 3}
    own |= {"stop": "zz", "ignore_eos": False}  # temperature 1: a JSON integer is a number
    rows = [
        {"prompt": "defaults"},
        {"prompt": "all its own", **own},
        {"prompt": "nulls", "seed": None, "stop": [], "max_tokens": None},
    ]
    status, output = generate_jsonl(
        make_engine, rows, "--max-tokens", "4", "--temperature", "0.5", "--top-p", "0.9",
        "--top-k", "7", "--seed", "11", "--stop", "END", "--stop", "FIN", "--ignore-eos",
    )  # fmt: skip

    assert status == 0
    from_flags = SamplingParams(
        max_tokens=4, temperature=0.5, top_p=0.9, top_k=7, seed=11, stop=("END", "FIN"),
        ignore_eos=True,
    )  # fmt: skip
    assert [r.sampling for r in requests] == [
        from_flags,
        SamplingParams(**{**own, "stop": ("zz",)}),
        dataclasses.replace(from_flags, stop=()),
    ]
    # The output rows keep their fields: no settings are echoed.
    assert [sorted(row) for row in output] == [
        ["adapter", "cached_tokens", "finish_reason", "prompt", "text", "token_ids"]
    ] * 3
    assert [len(row["token_ids"]) for row in output] == [4, 2, 4]


def test_prompts_file_max_tokens_and_stop_per_line(generate_jsonl):
    """One batch, each line stopping where its own settings say (the mock's tokens are a
    known function of the prompt: `mock_completion`; token t reads " t<t>")."""
    prompt = "Once upon a time"
    expected = mock_completion(list(prompt.encode()), None, 6, MOCK_VOCAB)
    text = MockTokenizer().decode(expected)  # " t548 t70 t517 t39 t486 t8"
    stop = f" t{expected[2]}"  # its first occurrence may start inside an earlier token
    rows = [
        {"prompt": prompt, "max_tokens": 2},
        {"prompt": prompt},  # --max-tokens 6
        {"prompt": prompt, "max_tokens": 1},
        {"prompt": prompt, "stop": stop},
        {"prompt": prompt, "stop": ["no such text", stop]},
    ]
    status, output = generate_jsonl(
        lambda slots: mock_engine(max_slots=slots, vocab_size=MOCK_VOCAB), rows, "--max-tokens", "6"
    )

    assert status == 0
    for row, count in zip(output[:3], (2, 6, 1), strict=True):
        assert row["token_ids"] == expected[:count] and row["finish_reason"] == "length", row
        assert row["text"] == MockTokenizer().decode(expected[:count])
    for row in output[3:]:
        assert row["finish_reason"] == "stop", row
        assert row["text"] == text[: text.index(stop)]
        assert len(row["token_ids"]) <= 3


def test_prompts_file_seed_and_temperature_per_line(generate_jsonl, tiny):
    """Seeded sampling on a real (random-weight) model: a line's seed gives the same text
    in any batch position, another seed another text, and a line without a temperature
    is greedy (--temperature 0) whatever its seed."""
    from configs import EngineConfig
    from jlora.device.llama_engine import build_engine

    def make_engine(slots):
        config = EngineConfig(max_slots=slots, max_seq_len=64)
        return build_engine(
            model_config=tiny.config, params=tiny.params, tokenizer=MockTokenizer(),
            engine_config=config,
        )  # fmt: skip

    prompt = "The three primary colors are"
    sampled = {"prompt": prompt, "temperature": 1.0, "top_k": 50}
    rows = [
        {**sampled, "seed": 1},
        {**sampled, "seed": 2},
        {**sampled, "seed": 1},
        {"prompt": prompt, "seed": 2},
        {"prompt": prompt},
    ]
    status, output = generate_jsonl(make_engine, rows, "--max-tokens", "8", "--ignore-eos")

    assert status == 0
    one, two, one_again, greedy_seeded, greedy = [row["token_ids"] for row in output]
    assert len(one) == 8
    assert one == one_again and output[0]["text"] == output[2]["text"]
    assert one != two
    assert greedy_seeded == greedy != one


# (a setting on line 3 of a prompts file, fragments of the error after "line 3: ")
BAD_LINE_SETTINGS = [
    ({"max_tokens": -1}, ["max_tokens=-1 must be a positive integer"]),
    ({"max_tokens": "8"}, ["max_tokens='8' must be a positive integer"]),
    ({"max_tokens": True}, ["max_tokens=True"]),
    ({"max_tokens": 1.5}, ["max_tokens=1.5"]),
    ({"temperature": "0.7"}, ["temperature='0.7'", "[0, 100]"]),
    ({"temperature": -1}, ["temperature=-1", "[0, 100]"]),
    ({"top_p": 0}, ["top_p=0", "(0, 1]"]),
    ({"top_p": [0.5]}, ["top_p=[0.5]"]),
    ({"top_k": -1}, ["top_k=-1"]),
    ({"seed": -1}, ["seed=-1", "[0, 2**32)"]),
    ({"seed": 2**32}, ["seed=4294967296"]),
    ({"seed": "7"}, ["seed='7'"]),
    ({"stop": 5}, ["stop=5 must be a string or a list of strings"]),
    ({"stop": ["a", 1]}, ["stop=['a', 1] must be a string or a list of strings"]),
    ({"stop": ""}, ["stop=('',)", "non-empty strings"]),
    ({"stop": [str(i) for i in range(17)]}, ["at most 16"]),
    ({"ignore_eos": "yes"}, ["ignore_eos='yes' must be true or false"]),
    ({"ignore_eos": 1}, ["ignore_eos=1"]),
    ({"repetition_penalty": 0}, ["repetition_penalty=0", "(0, 100]"]),
    ({"logit_bias": [[5, 1.0]]}, ["logit_bias=[[5, 1.0]] must map token ids to biases"]),
    ({"logit_bias": {"5": 300}}, ["logit_bias", "[-100, 100]"]),
    ({"stop_token_ids": 5}, ["stop_token_ids=5 must be a list of token ids"]),
    ({"skip_special_tokens": "no"}, ["skip_special_tokens='no' must be true or false"]),
    (
        {"max_new_tokens": 8},
        [
            "unknown fields ['max_new_tokens']",
            "(expected prompt, adapter, max_tokens, temperature, top_p, top_k, seed, stop, "
            "ignore_eos, logprobs, prompt_logprobs, presence_penalty,",
        ],
    ),
]


@pytest.mark.parametrize(
    ("setting", "fragments"),
    [
        pytest.param(setting, fragments, id="{}={!r}".format(*next(iter(setting.items())))[:32])
        for setting, fragments in BAD_LINE_SETTINGS
    ],
)
def test_prompts_file_bad_setting_names_line_and_field(
    tmp_path, monkeypatch, capsys, setting, fragments
):
    """Refused before the model is loaded: nothing runs, nothing is printed."""
    path = tmp_path / "p.jsonl"
    path.write_text(
        json.dumps({"prompt": "fine", "max_tokens": 2}) + "\n\n"
        + json.dumps({"prompt": "bad", **setting}) + "\n"
    )  # fmt: skip

    def no_model(args, adapters):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(generate, "_load", no_model)
    with pytest.raises(UsageError) as refused:
        generate.run(build_parser().parse_args(["generate", "--prompts-file", str(path)]))
    message = str(refused.value)
    assert message.startswith(f"--prompts-file {path} line 3: "), message
    for fragment in fragments:
        assert fragment in message
    assert capsys.readouterr().out == ""


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
    # The runs also keep adapters apart: in slots of their own, and in the KV cache's
    # pages (the default). The Pallas backends meet a mixed batch of SmolLM2 in
    # tests/test_lora_parity_peft.py.
    for mode, pool in (("ondemand", "slots"), ("cached", "kv")):
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
            "--lora-pool",
            pool,
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


@pytest.mark.parametrize(
    "backend, kind, form",
    [("mbgmv", None, "mbgmv"), ("bgmv", None, "bgmv"), ("reference", None, "bgmv"),
     ("reference", "mbgmv", "mbgmv"), ("mbgmv", "bgmv", "bgmv")],
)  # fmt: skip
def test_profile_fits_the_form_of_its_backend_unless_told(backend, kind, form):
    assert profile.model_kind(backend, kind) == form


def test_profile_writes_a_profile_the_router_loads(tmp_path, cli_env):
    """`jlora profile` on cpu-tiny: both models fitted over every profiled batch, printed
    with R², and saved in the format `router.perf_model.PerfProfile.load` reads. On the
    reference backend, with the MBGMV form asked for: interpreted Pallas kernels would
    time nothing a GPU runs, and compile 8 s longer."""
    from router.perf_model import PerfProfile

    out = tmp_path / "profile.json"
    result = _jlora(
        cli_env, "profile", "--model", "cpu-tiny", "--out", str(out), "--batches", "1,3",
        "--ranks", "4,16", "--prompt-lens", "16,32", "--repeats", "2",
        "--lora-backend", "reference", "--kind", "mbgmv", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    profile = PerfProfile.load(out)
    assert profile.decode.kind == profile.prefill.kind == "mbgmv"
    assert profile.decode.n_samples == 2 * 3  # 2 sizes x (2 uniform ranks + 1 mix)
    assert profile.prefill.n_samples == 2 * 2  # 2 lengths x 2 ranks
    assert "R² =" in result.stdout and profile.base_model == "cpu-tiny"
