"""The engine: request state, paged KV blocks, jitted steps and the batching loop."""
