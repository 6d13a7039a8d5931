"""LoRA adapters: PEFT loading, the shared-memory host store, device slots, and the
batched LoRA backends the model calls (see "Adapters" in DESIGN.md)."""
