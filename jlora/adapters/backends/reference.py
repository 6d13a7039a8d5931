"""The reference backend: plain jnp on Punica's stacked layout, every slot padded.

    weights[target] = {"a": [L, N, in, R], "b": [L, N, R, out]}

An adapter crosses the host-to-device link rank-exact (base.py); `install` pads it
into its slot on the device.

Padding is exact: padded columns of x @ A are zeros, and the matching rows of B are
zeros, so they add nothing. Cost ∝ rows × max_rank (like BGMV), whatever the ranks
in the batch; in prefill, times the segments that have an adapter and rows (each is a
masked product over every row). When no row has an adapter, a `lax.cond` skips the
LoRA work entirely.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jlora.adapters.backends.base import (
    LoraBackend,
    LoraWeights,
    Payload,
    exact_factors,
    padded_factors,
    set_slot,
)


def _lora(x: jax.Array, a: jax.Array, b: jax.Array, spec: str) -> jax.Array:
    """x @ a @ b in fp32, the intermediate rounded to x.dtype (base.py's arithmetic)."""
    xa_spec, ab_spec = spec.split("|")
    xa = jnp.einsum(xa_spec, x, a, preferred_element_type=jnp.float32).astype(x.dtype)
    return jnp.einsum(ab_spec, xa, b, preferred_element_type=jnp.float32)


def _add_where(adapted: jax.Array, y: jax.Array, delta: jax.Array) -> jax.Array:
    """y + delta (in fp32, rounded once) on adapted rows; other rows keep y's bits."""
    return jnp.where(adapted[:, None], (y.astype(jnp.float32) + delta).astype(y.dtype), y)


def _unless_all_base(slots: jax.Array, compute, y: jax.Array) -> jax.Array:
    """compute() if any slot is an adapter's (>= 0), else y: a batch of base-model rows
    skips the LoRA work (and reads no adapter weights) at run time."""
    return jax.lax.cond(jnp.any(slots >= 0), compute, lambda: y)


class ReferenceBackend(LoraBackend):
    """Plain jnp: a per-row gather for decode, one masked product per segment for prefill."""

    name = "reference"
    layout = {"a": ("layers", "slot", "in", "rank"), "b": ("layers", "slot", "rank", "out")}
    payload_layout = {"a": ("layers", "in", "rank"), "b": ("layers", "rank", "out")}

    def allocate(
        self, *, num_layers, num_slots, max_rank, shapes, dtype, rank_shards=1
    ) -> LoraWeights:
        rdim = self.rank_dim(max_rank, rank_shards)
        return {
            target: {
                "a": jnp.zeros((num_layers, num_slots, fan_in, rdim), dtype),
                "b": jnp.zeros((num_layers, num_slots, rdim, fan_out), dtype),
            }
            for target, (fan_in, fan_out) in shapes.items()
        }

    def pack(self, tensors, *, slot, shapes, max_rank, dtype, rank_shards=1) -> Payload:
        """{"a": [L, in, Q], "b": [L, P, out]} per target the adapter adapts."""
        rdim = self.rank_dim(max_rank, rank_shards)
        return exact_factors(tensors, shapes, rdim, rank_shards, dtype, a_axis=2)

    def install(self, weights, slot, layer_start, payload) -> LoraWeights:
        padded: Payload = {}
        for target, w in weights.items():
            _, _, fan_in, rdim = w["a"].shape
            widths = (fan_in, w["b"].shape[-1])
            a, b = padded_factors(payload, target, rdim, widths, w["a"].dtype, a_axis=2)
            padded[target] = {"a": a, "b": b}
        return set_slot(weights, slot, layer_start, padded)

    def factors(self, weights, target, layer, slots) -> tuple[jax.Array, jax.Array]:
        return weights[target]["a"][layer, slots], weights[target]["b"][layer, slots]

    def bgmv(self, weights, target, layer, x, y, idx) -> jax.Array:
        a_slots, b_slots = weights[target]["a"], weights[target]["b"]

        def compute() -> jax.Array:
            safe = jnp.maximum(idx, 0)
            delta = _lora(x, a_slots[layer, safe], b_slots[layer, safe], "si,sir->sr|sr,sro->so")
            return _add_where(idx >= 0, y, delta)

        return _unless_all_base(idx, compute, y)

    def sgmv(self, weights, target, layer, x, y, segments) -> jax.Array:
        a_slots, b_slots = weights[target]["a"], weights[target]["b"]
        rows = jnp.arange(x.shape[0])
        slots, starts = jnp.asarray(segments.slot), jnp.asarray(segments.start)

        def segment(g, carry):
            delta, adapted = carry
            slot = slots[g]
            safe = jnp.maximum(slot, 0)
            part = _lora(x, a_slots[layer, safe], b_slots[layer, safe], "ti,ir->tr|tr,ro->to")
            inside = (rows >= starts[g]) & (rows < starts[g + 1]) & (slot >= 0)
            return jnp.where(inside[:, None], part, delta), adapted | inside

        def skipping(g, carry):
            """`segment`, at no cost for an empty or base-model segment (a packed prefill
            pads with them)."""
            inside = (rows >= starts[g]) & (rows < starts[g + 1]) & (slots[g] >= 0)
            return jax.lax.cond(jnp.any(inside), lambda: segment(g, carry), lambda: carry)

        def compute() -> jax.Array:
            carry = (jnp.zeros(y.shape, jnp.float32), jnp.zeros(x.shape[0], bool))
            if slots.shape[0] == 1:  # one prompt's prefill
                delta, adapted = segment(0, carry)
            else:  # a loop: the compiled step does not grow with the segments
                delta, adapted = jax.lax.fori_loop(0, slots.shape[0], skipping, carry)
            return _add_where(adapted, y, delta)

        return _unless_all_base(segments.slot, compute, y)
