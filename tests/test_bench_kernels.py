"""bench.kernels' options, in interpret mode: --batches and --ranks narrow the plan, and
--tune times every variant with its settings in force, then restores the defaults."""

from __future__ import annotations

import json

import pallas_kernels.bgmv.kernel as bgmv_kernel
from bench import kernels
from pallas_kernels import common


def test_tune_traces_each_variant_with_its_settings_and_restores_the_defaults(
    monkeypatch, tmp_path
):
    defaults = (common.NUM_WARPS, bgmv_kernel.IN_BLOCK_CAP)
    variants = {"default": {}, "8 warps, blocks 64": {"NUM_WARPS": 8, "IN_BLOCK_CAP": 64}}
    monkeypatch.setattr(kernels, "TUNE_VARIANTS", variants)
    monkeypatch.setattr(kernels, "TUNE_RANKS", ((8,),))
    traced = []  # the settings each pallas_call was traced with
    params = common.triton_params
    monkeypatch.setattr(
        common,
        "triton_params",
        lambda: traced.append((common.NUM_WARPS, bgmv_kernel.IN_BLOCK_CAP)) or params(),
    )
    out = tmp_path / "kernels.json"
    kernels.main(["--quick", "--batches", "4", "--ranks", "8", "--tune", "--json", str(out)])

    report = json.loads(out.read_text())
    assert report["plan"]["batch_sizes"] == [4] and report["plan"]["uniform_ranks"] == [8]
    assert {(r["rows"], r["ranks"]) for r in report["results"] if r["kernel"] != "sgmv"} == {
        (4, "8"),
        (4, "128,64,32x2"),
    }
    tuned = {(r["variant"], r["kernel"], r["ranks"]) for r in report["tuning"]}
    assert tuned == {(v, k, "8") for v in variants for k in ("bgmv", "mbgmv")}
    assert defaults in traced and (8, 64) in traced
    assert defaults == (common.NUM_WARPS, bgmv_kernel.IN_BLOCK_CAP)
