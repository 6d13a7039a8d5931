"""The op-count proxy (bench/lowered_ops.py): the decode step lowered for CUDA on the CPU,
over shapes alone. Each backend adds its two Triton kernels per target and layer; MBGMV
nothing else but the layer index's plumbing; the counts expand every called function."""

from __future__ import annotations

import collections

import pytest

from bench.lowered_ops import BACKENDS, lowered_decode, measure, op_counts

TARGETS = ("q_proj", "v_proj", "down_proj")


@pytest.fixture(scope="module")
def counts():
    import argparse

    args = argparse.Namespace(rows=4, slots=3, rank=8, targets=TARGETS)
    return measure("cpu-tiny", args)


def test_each_backend_adds_its_kernels_per_target_and_layer(counts):
    added = counts["added_per_layer"]
    assert added["no adapter row"] == {}
    for name in BACKENDS:
        kernels = {op: n for op, n in added[name].items() if op.startswith("triton:")}
        assert kernels == {f"triton:{name}_shrink": len(TARGETS),
                           f"triton:{name}_expand": len(TARGETS)}  # fmt: skip
    plumbing = set(added["mbgmv"]) - {"triton:mbgmv_shrink", "triton:mbgmv_expand"}
    assert plumbing <= {"convert", "reshape", "constant"}  # no reduce, gather or transpose


def test_called_functions_count_once_per_call():
    text = """module @m {
  func.func public @main(%arg0: tensor<2xf32>) -> tensor<2xf32> {
    %0 = call @f(%arg0) : (tensor<2xf32>) -> tensor<2xf32>
    %1 = call @f(%0) : (tensor<2xf32>) -> tensor<2xf32>
    %2 = stablehlo.custom_call @__gpu$xla.gpu.triton(%1) {name = "k", num_stages = 1 : i32}
    return %2 : tensor<2xf32>
  }
  func.func private @f(%arg0: tensor<2xf32>) -> tensor<2xf32> {
    %0 = stablehlo.add %arg0, %arg0 : tensor<2xf32>
    %1 = stablehlo.reduce(%0 init: %cst) applies stablehlo.add across dimensions = [0]
    return %0 : tensor<2xf32>
  }
}"""
    assert op_counts(text) == collections.Counter({"add": 2, "reduce": 2, "triton:k": 1})


def test_the_step_lowers_for_cuda_over_shapes_alone():
    text = lowered_decode("cpu-tiny", "bgmv", rows=2, slots=2, rank=8, targets=TARGETS)
    assert "__gpu$xla.gpu.triton" in text and 'name = "bgmv_shrink"' in text
