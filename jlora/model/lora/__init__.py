"""LoRA with the model: the projections an adapter may target (`targets`) and the
batched-LoRA backends the layers call (`base`: the interface; `reference`: plain jnp;
`pallas`: BGMV over stacked slots, MBGMV over a page pool; `backends`: by name). The
reference and MBGMV may keep their adapters in the KV cache's pages instead (pooled).
On a CPU device the host kernels (`jlora.model.host`) serve the pooled reference's
products.

Importing this package loads nothing: `targets` needs no jax, so host-side code (PEFT
parsing, the engine's bookkeeping) may import it.
"""
