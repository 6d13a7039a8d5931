"""Merged weights (dLoRA §4.1, merged inference): the base parameters with one adapter's
LoRA delta folded in, so that a step serving only that adapter does no LoRA work.

Semantics: for each target projection t the adapter has, and every layer l,

    W'[t][l] = W[t][l] + A[t][l] @ B[t][l]        (the scaling is in B: the host store)

the product and the sum in fp32 at full precision, rounded once to W's dtype. Every
other parameter, and every target the adapter does not have, is the pristine array
itself, not a copy. A and B come from the host store (jlora/adapters/store.py: float32,
layer-major, at the adapter's own rank), so merging does not depend on how the LoRA
backend lays adapters out on the device.

On a mesh the fold runs where the weights live, in one compiled call whose outputs
have the base kernels' shardings: A is split like W's input and B like W's output, so
each device computes only its own block of the delta (row-parallel o/down: rows of W;
column-parallel q/k/v/gate/up: columns), with no collective. Where the KV heads are
replicated (`TensorParallel.kv_replicas` > 1) k/v's B is widened the way their kernels
were (`expand_kv`), from a replicated copy.

The pristine parameters are never modified (JAX arrays are immutable): unmerging is
putting them back, bit for bit, never subtracting the delta (which would not restore
bf16 weights). While merged, the device holds both copies of the adapter's targets.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jlora.model.dots import einsum_f32
from jlora.model.llama import Params
from jlora.model.lora.base import HostTensors
from jlora.model.lora.targets import TARGETS
from jlora.model.sharding import TARGET_AXES, TensorParallel

log = logging.getLogger(__name__)

Kernels = dict[str, jax.Array]  # target -> its stacked base kernel [L, in, out]
Factors = dict[str, tuple[jax.Array, jax.Array]]  # target -> (A [L, in, r], B [L, r, out])


class WeightMerger:
    """Folds one adapter at a time into parameters placed on `tp`'s mesh (`params` gives
    the kernels' shapes, dtypes and shardings; nothing of it is kept)."""

    def __init__(self, tp: TensorParallel, params: Params) -> None:
        self._tp = tp
        kernels = {target: params["layers"][target]["kernel"] for target in TARGETS}
        self._kernels = {
            target: jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=w.sharding)
            for target, w in kernels.items()
        }
        self._executables: dict[tuple[tuple[str, ...], int], Any] = {}
        self.num_compiles = 0
        self.warmed_up = False  # set by the engine once warm-up is done

    def _factor_shardings(self, target: str) -> tuple[NamedSharding, NamedSharding]:
        """A split like W's input, B like W's output (replicated where k/v are widened)."""
        tp, (fan_in, fan_out) = self._tp, TARGET_AXES[target]
        widened = target in ("k_proj", "v_proj") and tp.kv_replicas > 1
        b_spec = PartitionSpec() if widened else tp.spec("layers", None, fan_out)
        return (
            NamedSharding(tp.mesh, tp.spec("layers", fan_in, None)),
            NamedSharding(tp.mesh, b_spec),
        )

    def _fold(self, kernels: Kernels, factors: Factors) -> Kernels:
        merged = {}
        for target, (lora_a, lora_b) in factors.items():
            if target in ("k_proj", "v_proj"):
                lora_b = self._tp.expand_kv(lora_b)  # as wide as the replicated KV heads
            delta = einsum_f32(
                "lir,lro->lio",
                lora_a,
                lora_b,
                precision=jax.lax.Precision.HIGHEST,
            )
            kernel = kernels[target]
            merged[target] = (kernel.astype(jnp.float32) + delta).astype(kernel.dtype)
        return merged

    def compile(self, targets: tuple[str, ...], rank: int) -> Any:
        """The fold of an adapter of these targets (canonical order) and rank, compiled
        once (a shape first met after warm-up is logged as a warning)."""
        key = (tuple(targets), rank)
        if key in self._executables:
            return self._executables[key]
        kernels = {target: self._kernels[target] for target in targets}
        factors = {}
        for target in targets:
            layers, fan_in, fan_out = self._kernels[target].shape
            if target in ("k_proj", "v_proj"):
                fan_out //= self._tp.kv_replicas  # the adapter's own width
            a_sharding, b_sharding = self._factor_shardings(target)
            factors[target] = (
                jax.ShapeDtypeStruct((layers, fan_in, rank), jnp.float32, sharding=a_sharding),
                jax.ShapeDtypeStruct((layers, rank, fan_out), jnp.float32, sharding=b_sharding),
            )
        fold = jax.jit(self._fold, out_shardings={t: k.sharding for t, k in kernels.items()})
        start = time.perf_counter()
        executable = fold.lower(kernels, factors).compile()
        self.num_compiles += 1
        log.log(
            logging.WARNING if self.warmed_up else logging.INFO,
            "compiled merge[%s, r=%d] in %.1f s%s",
            ",".join(targets),
            rank,
            time.perf_counter() - start,
            " after warm-up" if self.warmed_up else "",
        )
        self._executables[key] = executable
        return executable

    def merge(self, params: Params, tensors: HostTensors) -> Params:
        """`params` with the adapter `tensors` (target -> A [L, in, r], B·scaling
        [L, r, out], host arrays) folded in, once the merged kernels are ready; the
        arrays of every other parameter are `params`' own."""
        targets = tuple(target for target in TARGETS if target in tensors)
        rank = next(iter(tensors.values()))[0].shape[-1]
        executable = self.compile(targets, rank)
        factors = {}
        for target in targets:
            lora_a, lora_b = tensors[target]
            a_sharding, b_sharding = self._factor_shardings(target)
            factors[target] = (
                jax.device_put(lora_a, a_sharding),
                jax.device_put(lora_b, b_sharding),
            )
        kernels = {target: params["layers"][target]["kernel"] for target in targets}
        merged = jax.block_until_ready(executable(kernels, factors))
        layers = dict(params["layers"])
        for target, kernel in merged.items():
            layers[target] = {**layers[target], "kernel": kernel}
        return {**params, "layers": layers}
