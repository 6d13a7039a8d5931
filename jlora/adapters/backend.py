"""Batched LoRA: the interface the model calls, and the plain-jnp reference backend.

For each adapted projection y = x @ W of a layer, a backend adds the LoRA delta of
each row's adapter (Toppings §2.1, Eq. 1: y' = xW + xAB), with the scaling already
folded into B by the host store:

    decode  (BGMV form):  y[s] += x[s] @ A[layer, idx[s]] @ B[layer, idx[s]]
    prefill (SGMV form):  y[t] += x[t] @ A[layer, slot[g]] @ B[layer, slot[g]]
                          for the segment g with start[g] <= t < start[g + 1]

A slot index of -1 means "no adapter": that row's y is left bit-identical.

Device layout (`allocate`) is the backend's choice; the reference keeps one stacked
array pair per target, every slot padded to `max_rank` with zeros (Punica's layout):

    weights[target] = {"a": [L, N, in, R], "b": [L, N, R, out]}

Padding is exact: padded columns of x @ A are zeros, and the matching rows of B are
zeros, so they add nothing. The Pallas kernels (BGMV, MBGMV, SGMV) implement the same
interface with their own layouts.
"""

from __future__ import annotations

import abc
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

LoraWeights = dict[str, dict[str, jax.Array]]  # device slots, layout chosen by the backend
HostTensors = dict[str, tuple[np.ndarray, np.ndarray]]  # target -> (A [L,in,r], B [L,r,out])
Payload = dict[str, dict[str, Any]]  # one adapter, packed for `install` (numpy or device)


@struct.dataclass
class Segments:
    """Prefill rows grouped by adapter (the SGMV form).

    slot: i32[G], the device slot of each segment's adapter (-1: no adapter).
    start: i32[G + 1], non-decreasing row offsets; segment g is rows
      start[g]:start[g + 1]; rows at or after start[G] have no adapter.
    """

    slot: jax.Array | np.ndarray
    start: jax.Array | np.ndarray

    @staticmethod
    def single(slot: int, rows: int) -> Segments:
        """One segment covering `rows` rows (host-side numpy, ready to pass to a step)."""
        return Segments(slot=np.array([slot], np.int32), start=np.array([0, rows], np.int32))


class LoraBackend(abc.ABC):
    """How adapters sit in device memory and how the batched delta is computed."""

    name: str

    @abc.abstractmethod
    def allocate(
        self,
        *,
        num_layers: int,
        num_slots: int,
        max_rank: int,
        shapes: dict[str, tuple[int, int]],
        dtype: Any,
    ) -> LoraWeights:
        """Zeroed device slots for `num_slots` adapters of rank <= max_rank.

        shapes: target -> (in_features, out_features), the targets the slots hold.
        """

    @abc.abstractmethod
    def pack(
        self, tensors: HostTensors, *, shapes: dict[str, tuple[int, int]], max_rank: int, dtype: Any
    ) -> Payload:
        """One adapter's host tensors in the layout `install` takes (numpy, on the host).

        Targets in `shapes` that the adapter does not adapt are packed as zeros.
        """

    @abc.abstractmethod
    def install(self, weights: LoraWeights, slot: jax.Array, payload: Payload) -> LoraWeights:
        """Write one packed adapter into slot `slot` (traceable; jit it with donation)."""

    @abc.abstractmethod
    def bgmv(
        self, weights: LoraWeights, target: str, layer: jax.Array, x: jax.Array, idx: jax.Array
    ) -> jax.Array:
        """Decode form. x: [S, in]; idx: i32[S] (-1: no adapter) -> delta [S, out], x.dtype."""

    @abc.abstractmethod
    def sgmv(
        self,
        weights: LoraWeights,
        target: str,
        layer: jax.Array,
        x: jax.Array,
        segments: Segments,
    ) -> jax.Array:
        """Prefill form. x: [T, in]; segments as in `Segments` -> delta [T, out], x.dtype."""


def _lora(x: jax.Array, a: jax.Array, b: jax.Array, spec: str) -> jax.Array:
    """x @ a @ b with fp32 accumulation; the intermediate is rounded to x.dtype (as PEFT's
    two Linear layers do)."""
    xa_spec, ab_spec = spec.split("|")
    xa = jnp.einsum(xa_spec, x, a, preferred_element_type=jnp.float32).astype(x.dtype)
    return jnp.einsum(ab_spec, xa, b, preferred_element_type=jnp.float32)


def _unless_all_base(slots: jax.Array, compute, shape: tuple[int, ...], dtype) -> jax.Array:
    """compute() if any slot is an adapter's (>= 0), else zeros: a batch of base-model rows
    skips the LoRA work (and reads no adapter weights) at run time."""
    return jax.lax.cond(jnp.any(slots >= 0), compute, lambda: jnp.zeros(shape, dtype))


class ReferenceBackend(LoraBackend):
    """Plain jnp: a per-row gather for decode, one masked product per segment for prefill.

    Cost ∝ rows × max_rank (like BGMV), whatever the ranks in the batch. When no row
    has an adapter, a `lax.cond` skips the LoRA work entirely.
    """

    name = "reference"

    def allocate(self, *, num_layers, num_slots, max_rank, shapes, dtype) -> LoraWeights:
        return {
            target: {
                "a": jnp.zeros((num_layers, num_slots, fan_in, max_rank), dtype),
                "b": jnp.zeros((num_layers, num_slots, max_rank, fan_out), dtype),
            }
            for target, (fan_in, fan_out) in shapes.items()
        }

    def pack(self, tensors, *, shapes, max_rank, dtype) -> Payload:
        payload: Payload = {}
        layers = next(iter(tensors.values()))[0].shape[0]
        for target, (fan_in, fan_out) in shapes.items():
            a = np.zeros((layers, fan_in, max_rank), dtype)
            b = np.zeros((layers, max_rank, fan_out), dtype)
            if target in tensors:
                lora_a, lora_b = tensors[target]
                rank = lora_a.shape[-1]
                a[:, :, :rank] = lora_a
                b[:, :rank, :] = lora_b
            payload[target] = {"a": a, "b": b}
        return payload

    def install(self, weights, slot, payload) -> LoraWeights:
        return {
            target: {
                part: weights[target][part].at[:, slot].set(payload[target][part])
                for part in ("a", "b")
            }
            for target in weights
        }

    def bgmv(self, weights, target, layer, x, idx) -> jax.Array:
        a_slots, b_slots = weights[target]["a"], weights[target]["b"]
        fan_out = b_slots.shape[-1]

        def compute() -> jax.Array:
            safe = jnp.maximum(idx, 0)
            delta = _lora(x, a_slots[layer, safe], b_slots[layer, safe], "si,sir->sr|sr,sro->so")
            return jnp.where((idx >= 0)[:, None], delta, 0.0).astype(x.dtype)

        return _unless_all_base(idx, compute, (x.shape[0], fan_out), x.dtype)

    def sgmv(self, weights, target, layer, x, segments) -> jax.Array:
        a_slots, b_slots = weights[target]["a"], weights[target]["b"]
        rows = jnp.arange(x.shape[0])
        fan_out = b_slots.shape[-1]

        def compute() -> jax.Array:
            delta = jnp.zeros((x.shape[0], fan_out), jnp.float32)
            for g in range(segments.slot.shape[0]):
                slot = segments.slot[g]
                safe = jnp.maximum(slot, 0)
                part = _lora(x, a_slots[layer, safe], b_slots[layer, safe], "ti,ir->tr|tr,ro->to")
                inside = (rows >= segments.start[g]) & (rows < segments.start[g + 1]) & (slot >= 0)
                delta = jnp.where(inside[:, None], part, delta)
            return delta.astype(x.dtype)

        return _unless_all_base(segments.slot, compute, (x.shape[0], fan_out), x.dtype)


BACKENDS: dict[str, type[LoraBackend]] = {"reference": ReferenceBackend}


def make_backend(name: str) -> LoraBackend:
    if name not in BACKENDS:
        raise ValueError(f"lora_backend={name!r} must be one of {sorted(BACKENDS)}")
    return BACKENDS[name]()
