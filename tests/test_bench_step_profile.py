"""bench.step_profile: the trace summary (busy time as a union of intervals, ops by name
without their numeric suffixes), and a run of every variant on cpu-tiny that restores
what it patched."""

from __future__ import annotations

import json
import tempfile
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest

from bench import step_profile
from jlora.device.steps import CompiledSteps
from jlora.model.host import layer_views


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


def test_variants_run_and_are_undone(tmp_path, monkeypatch):
    """copies-unrolled decodes with per-layer copies and the loop unrolled, and undoes the
    copies' patch; the reference backend, as interpreted Pallas kernels would take
    minutes to compile cold. Without --trace-dir the traces are deleted."""
    init, split = CompiledSteps.__init__, layer_views.split_layers
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    out = tmp_path / "profile.json"
    step_profile.main(
        ["--model", "cpu-tiny", "--dtype", "float32", "--batch", "2", "--adapters", "2",
         "--backend", "reference", "--steps", "2", "--variants", "stacked,copies-unrolled",
         "--json", str(out), "--markdown", str(tmp_path / "profile.md")]
    )  # fmt: skip
    systems = [r["system"] for r in json.loads(out.read_text())["results"]]
    assert systems == [
        "no-lora", "reference k=2", "no-lora, copies-unrolled", "reference k=2, copies-unrolled",
    ]  # fmt: skip
    assert "| reference k=2, copies-unrolled |" in (tmp_path / "profile.md").read_text()
    assert (CompiledSteps.__init__, layer_views.split_layers) == (init, split)
    assert not list(scratch.iterdir())


def test_a_lora_engine_with_no_adapter_in_the_batch_is_a_system_of_its_own(tmp_path):
    """--adapters 0,2: no-lora, the LoRA engine whose rows have no adapter (its LoRA
    code's own cost), and the same with rows over 2 adapters."""
    out = tmp_path / "profile.json"
    step_profile.main(
        ["--model", "cpu-tiny", "--dtype", "float32", "--batch", "2", "--adapters", "0,2",
         "--backend", "reference", "--steps", "2", "--json", str(out)]
    )  # fmt: skip
    results = json.loads(out.read_text())["results"]
    assert [r["system"] for r in results] == ["no-lora", "reference k=0", "reference k=2"]
    assert all(r["wall_ms"] > 0 for r in results)


@pytest.mark.parametrize("counts", ["0", "-1,2", "two"])
def test_adapter_counts_are_refused_unless_one_is_positive(counts, capsys):
    with pytest.raises(SystemExit):
        step_profile.main(["--model", "cpu-tiny", "--adapters", counts])
    assert "--adapters" in capsys.readouterr().err


def test_an_unknown_variant_is_refused(capsys):
    with pytest.raises(SystemExit):
        step_profile.main(["--model", "cpu-tiny", "--variants", "stacked,fused"])
    assert "--variants: ['fused'] not in" in capsys.readouterr().err


def test_ops_are_told_apart_by_the_shape_they_produce():
    def event(name: str, long_name: str | None) -> SimpleNamespace:
        stats = [("hlo_category", "copy")] + ([("long_name", long_name)] if long_name else [])
        return SimpleNamespace(name=name, stats=stats, duration_ns=1000)

    line = SimpleNamespace(events=[
        event("loop_dynamic_slice_fusion.3", "%f.3 = bf16[4096,4096]{1,0} fusion(%p, %i)"),
        event("loop_dynamic_slice_fusion.9", "%f.9 = bf16[4096,4096]{1,0} fusion(%q, %i)"),
        event("loop_dynamic_slice_fusion.4", "%f.4 = f32[4096]{0} fusion(%n, %i)"),
        event("wrapped_add.2", None),
    ])  # fmt: skip
    ops = {name: count for name, _, count in step_profile.top([line], steps=1)}
    assert ops == {
        "loop_dynamic_slice_fusion bf16[4096,4096]": 2,
        "loop_dynamic_slice_fusion f32[4096]": 1,
        "wrapped_add": 1,
    }
