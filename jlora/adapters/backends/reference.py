"""The reference backend: plain jnp on Punica's stacked layout, every slot padded.

    weights[target] = {"a": [L, N, in, R], "b": [L, N, R, out],
                       "rank": i32[N] (0: the slot's adapter does not adapt target)}

An adapter crosses the host-to-device link rank-exact (base.py); `install` pads it
into its slot on the device.

Padding is exact: padded columns of x @ A are zeros, and the matching rows of B are
zeros, so they add nothing. A decode step's LoRA takes one of two forms, chosen by its
row bucket and the slot count (both static, so each compiled step holds one form;
`ReferenceBackend.over_slots`): a per-row gather of each row's slot (cost ∝ rows ×
max_rank, like BGMV, but the gather copies each row's factors first), or one product
over every slot, each row's other slots zeroed between the two halves (it reads each
slot once, in place; cost ∝ rows × slots × max_rank in flops). A prefill's LoRA costs
∝ rows × max_rank times the segments that have an adapter (each is a masked product
over every row, or over its `Segments.window` rows where the segments are bounded: a
packed prefill's, whose LoRA then costs about its prompt rows' worth, not the
segments' times the call's). When no row's adapter adapts a target (no row has an
adapter, or theirs leave that projection alone), a `lax.cond` skips that target's LoRA
work entirely: slots hold every target the engine serves (EngineConfig.lora_targets),
and q/v adapters in all-seven slots then cost what their two targets do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jlora.adapters.backends.base import (
    LoraBackend,
    LoraWeights,
    Payload,
    exact_factors,
    padded_factors,
    set_slot,
)
from jlora.model.dots import einsum_f32


def _lora(x: jax.Array, a: jax.Array, b: jax.Array, spec: str) -> jax.Array:
    """x @ a @ b in fp32, the intermediate rounded to x.dtype (base.py's arithmetic)."""
    xa_spec, ab_spec = spec.split("|")
    xa = einsum_f32(xa_spec, x, a).astype(x.dtype)
    return einsum_f32(ab_spec, xa, b)


def _add_where(adapted: jax.Array, y: jax.Array, delta: jax.Array) -> jax.Array:
    """y + delta (in fp32, rounded once) on adapted rows; other rows keep y's bits."""
    return jnp.where(adapted[:, None], (y.astype(jnp.float32) + delta).astype(y.dtype), y)


def _adapting(ranks: jax.Array, slots: jax.Array) -> jax.Array:
    """Which of `slots` (-1: none) hold an adapter of this target (rank > 0): bool[...]"""
    return (slots >= 0) & (ranks[jnp.maximum(slots, 0)] > 0)


def _unless_none(adapting: jax.Array, compute, y: jax.Array) -> jax.Array:
    """compute() if any row's (or segment's) adapter adapts the target, else y: a batch
    of base-model rows, or of adapters that leave this projection alone, skips its LoRA
    work (and reads no adapter weights) at run time."""
    return jax.lax.cond(jnp.any(adapting), compute, lambda: y)


DECODE_FORMS = ("auto", "gather", "over-slots")  # ReferenceBackend.decode_form's values


class ReferenceBackend(LoraBackend):
    """Plain jnp: a per-row gather or a product over every slot for decode, one masked
    product per segment for prefill."""

    name = "reference"
    # A segment costs reading its adapter (2.6 MB a SmolLM2 layer at rank 64 on every
    # target) plus its window's products (about 13 us a row on 2 cores): 32 rows balance
    # the two.
    segment_rows = 32
    # Decode's form: "auto" (`over_slots` decides), "gather" or "over-slots" (forced: the
    # benchmark's, bench.lora_decode --reference-forms).
    decode_form = "auto"
    layout = {
        "a": ("layers", "slot", "in", "rank"),
        "b": ("layers", "slot", "rank", "out"),
        "rank": ("slot",),
    }
    payload_layout = {"a": ("layers", "in", "rank"), "b": ("layers", "rank", "out"), "rank": ()}

    def allocate(
        self, *, num_layers, num_slots, max_rank, shapes, dtype, rank_shards=1
    ) -> LoraWeights:
        rdim = self.rank_dim(max_rank, rank_shards)
        return {
            target: {
                "a": jnp.zeros((num_layers, num_slots, fan_in, rdim), dtype),
                "b": jnp.zeros((num_layers, num_slots, rdim, fan_out), dtype),
                "rank": jnp.zeros((num_slots,), jnp.int32),
            }
            for target, (fan_in, fan_out) in shapes.items()
        }

    def pack(self, tensors, *, slot, shapes, max_rank, dtype, rank_shards=1) -> Payload:
        """{"a": [L, in, Q], "b": [L, P, out], "rank": i32} per target the adapter adapts."""
        rdim = self.rank_dim(max_rank, rank_shards)
        payload = exact_factors(tensors, shapes, rdim, rank_shards, dtype, a_axis=2)
        for target, packed in payload.items():
            packed["rank"] = np.int32(tensors[target][0].shape[-1])
        return payload

    def install(self, weights, slot, layer_start, payload) -> LoraWeights:
        padded: Payload = {}
        for target, w in weights.items():
            _, _, fan_in, rdim = w["a"].shape
            widths = (fan_in, w["b"].shape[-1])
            a, b = padded_factors(payload, target, rdim, widths, w["a"].dtype, a_axis=2)
            rank = payload[target]["rank"] if target in payload else np.int32(0)
            padded[target] = {"a": a, "b": b, "rank": rank}
        return set_slot(weights, slot, layer_start, padded)

    def factors(self, weights, target, layer, slots) -> tuple[jax.Array, jax.Array]:
        return weights[target]["a"][layer, slots], weights[target]["b"][layer, slots]

    def over_slots(self, rows: int, slots: int) -> bool:
        """Whether a decode of `rows` rows over `slots` slots takes the product over every
        slot rather than the per-row gather. On XLA:CPU (SmolLM2's seven targets, 30
        layers, 2 Zen 5 cores; bench/results/2026-11-28-cpu-reference-decode.md) the
        gather's copy costs about 0.06 ms per row and rank unit whatever the slots, the
        product about 0.008, 0.005 and 0.003 ms per row, slot and rank unit at 8, 16
        and 32 rows (its GEMMs grow more efficient with rows): the product wins while
        2 × slots < rows + 8, which held at each of the nine shapes measured."""
        if self.decode_form != "auto":
            return self.decode_form == "over-slots"
        return 2 * slots < rows + 8

    def bgmv(self, weights, target, layer, x, y, idx) -> jax.Array:
        w = weights[target]
        adapting = _adapting(w["rank"], idx)
        slots = w["a"].shape[1]

        def gathered() -> jax.Array:
            safe = jnp.maximum(idx, 0)
            delta = _lora(x, w["a"][layer, safe], w["b"][layer, safe], "si,sir->sr|sr,sro->so")
            return _add_where(adapting, y, delta)

        def through_every_slot() -> jax.Array:
            xa = einsum_f32("si,nir->snr", x, w["a"][layer]).astype(x.dtype)  # every slot
            mine = idx[:, None] == jnp.arange(slots)[None, :]  # [S, N]: the row's own
            xa = jnp.where(mine[:, :, None], xa, jnp.zeros((), x.dtype))
            return _add_where(adapting, y, einsum_f32("snr,nro->so", xa, w["b"][layer]))

        compute = through_every_slot if self.over_slots(x.shape[0], slots) else gathered
        return _unless_none(adapting, compute, y)

    def sgmv(self, weights, target, layer, x, y, segments) -> jax.Array:
        w = weights[target]
        rows = jnp.arange(x.shape[0])
        slots, starts = jnp.asarray(segments.slot), jnp.asarray(segments.start)
        adapting = _adapting(w["rank"], slots)  # [G]
        window = min(segments.window or x.shape[0], x.shape[0])

        def segment(g, carry):
            """Segment g's delta over the `window` rows from its start (every row when
            unbounded), the rest of the window left as it was."""
            delta, adapted = carry
            safe = jnp.maximum(slots[g], 0)
            low = jnp.clip(starts[g], 0, x.shape[0] - window)
            xs = jax.lax.dynamic_slice_in_dim(x, low, window)
            part = _lora(xs, w["a"][layer, safe], w["b"][layer, safe], "ti,ir->tr|tr,ro->to")
            seen = low + rows[:window]
            inside = (seen >= starts[g]) & (seen < starts[g + 1]) & adapting[g]
            old = jax.lax.dynamic_slice_in_dim(delta, low, window)
            was = jax.lax.dynamic_slice_in_dim(adapted, low, window)
            delta = jax.lax.dynamic_update_slice_in_dim(
                delta, jnp.where(inside[:, None], part, old), low, 0
            )
            return delta, jax.lax.dynamic_update_slice_in_dim(adapted, was | inside, low, 0)

        def skipping(g, carry):
            """`segment`, at no cost for an empty or base-model segment or one whose
            adapter leaves the target alone."""
            rows_there = (starts[g + 1] > starts[g]) & (starts[g] < x.shape[0])
            return jax.lax.cond(rows_there & adapting[g], lambda: segment(g, carry), lambda: carry)

        def compute() -> jax.Array:
            carry = (jnp.zeros(y.shape, jnp.float32), jnp.zeros(x.shape[0], bool))
            if slots.shape[0] == 1:  # one prompt's prefill
                delta, adapted = segment(0, carry)
            else:  # a loop: the compiled step does not grow with the segments; it stops
                # after the last segment with rows (a packed prefill's empty ones, which
                # pad it to its segment count, come last)
                used = jnp.max(
                    jnp.where(starts[1:] > starts[:-1], jnp.arange(1, len(slots) + 1), 0)
                )
                delta, adapted = jax.lax.fori_loop(0, used, skipping, carry)
            return _add_where(adapted, y, delta)

        return _unless_none(adapting, compute, y)
