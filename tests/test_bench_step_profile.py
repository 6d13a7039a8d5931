"""bench.step_profile: the trace summary (busy time as a union of intervals, ops by name
without their numeric suffixes), and a run of every variant on cpu-tiny that restores
what it patched."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest

from bench import step_profile
from jlora.engine.steps import CompiledSteps
from jlora.model import layer_views
from jlora.model.llama import Llama


def test_busy_time_is_the_union_of_intervals():
    assert step_profile._union_ns([]) == 0
    assert step_profile._union_ns([(0, 10), (5, 15), (20, 30), (21, 22)]) == 25
    assert step_profile._union_ns([(4, 6), (0, 10)]) == 10


def test_summarise_names_the_ops_of_a_real_trace(tmp_path):
    f = jax.jit(lambda x: jnp.tanh(x @ x) + 1)
    x = jnp.ones((256, 256))
    f(x).block_until_ready()
    with jax.profiler.trace(str(tmp_path)):
        for _ in range(4):
            f(x).block_until_ready()
    (path,) = tmp_path.glob("**/*.xplane.pb")
    summary = step_profile.summarise(step_profile.ProfileData.from_file(str(path)), steps=4)
    assert summary["busy_ms"] > 0 and summary["kernels"] >= 1
    names = [name for name, _, _ in summary["ops"]]
    assert names and not any(step_profile.SUFFIX.search(name) for name in names)
    times = [ms for _, ms, _ in summary["ops"]]
    assert times == sorted(times, reverse=True)


def test_every_variant_runs_and_is_undone(tmp_path):
    init, split = CompiledSteps.__init__, layer_views.split_layers
    out = tmp_path / "profile.json"
    step_profile.main(
        ["--model", "cpu-tiny", "--dtype", "float32", "--batch", "2", "--adapters", "2",
         "--steps", "2", "--variants", "stacked,copies,unrolled", "--json", str(out),
         "--markdown", str(tmp_path / "profile.md")]
    )  # fmt: skip
    systems = [r["system"] for r in json.loads(out.read_text())["results"]]
    assert systems == [
        "no-lora", "bgmv k=2", "no-lora, copies", "bgmv k=2, copies",
        "no-lora, unrolled", "bgmv k=2, unrolled",
    ]  # fmt: skip
    assert "| bgmv k=2, unrolled |" in (tmp_path / "profile.md").read_text()
    assert (CompiledSteps.__init__, layer_views.split_layers) == (init, split)
    assert Llama.scan_unroll == 1


def test_an_unknown_variant_is_refused(capsys):
    with pytest.raises(SystemExit):
        step_profile.main(["--model", "cpu-tiny", "--variants", "stacked,fused"])
    assert "--variants: ['fused'] not in" in capsys.readouterr().err
