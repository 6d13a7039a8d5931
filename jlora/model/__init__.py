"""The Llama-2 family model: Flax layers, a layer scan, paged attention, weight loaders."""
