"""Per-row sampling inside the jitted step: greedy, temperature, top-k, top-p, seed.

Every row carries its own parameters as arrays, so one compiled step serves any mix
of requests. A row's random key is `fold_in(PRNGKey(seed), step)`, where step is the
number of tokens the request has generated so far: a request's samples depend on
its seed alone, never on what else is in the batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jlora.engine.device_api import SamplingRow

Rows = jax.Array | np.ndarray  # numpy while the host fills it in, jax.Array inside the step


@struct.dataclass
class SamplingArrays:
    temperature: Rows  # f32[S]; 0 means greedy
    top_k: Rows  # i32[S]; 0 means no top-k cut
    top_p: Rows  # f32[S]; 1 means no nucleus cut
    seed: Rows  # u32[S]
    step: Rows  # i32[S]; tokens generated so far by the row's request


def sample(logits: jax.Array, params: SamplingArrays) -> jax.Array:
    """logits: f32[S, V] -> i32[S]. All-greedy batches skip the sort entirely."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.lax.cond(
        jnp.all(params.temperature == 0.0),
        lambda: greedy,
        lambda: jnp.where(params.temperature == 0.0, greedy, _sample_rows(logits, params)),
    )


def _sample_rows(logits: jax.Array, params: SamplingArrays) -> jax.Array:
    vocab = logits.shape[-1]
    temperature = jnp.where(params.temperature > 0, params.temperature, 1.0)
    scaled = logits / temperature[:, None]
    order = jnp.argsort(-scaled, axis=-1)  # descending
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(vocab)[None, :]
    top_k = jnp.where(params.top_k > 0, params.top_k, vocab)
    keep = rank < top_k[:, None]
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep &= (mass_before < params.top_p[:, None]) | (rank == 0)
    masked = jnp.where(keep, sorted_logits, -jnp.inf)

    def draw(row_logits, seed, step):
        key = jax.random.fold_in(jax.random.PRNGKey(seed), step)
        return jax.random.categorical(key, row_logits)

    choice = jax.vmap(draw)(masked, params.seed, params.step)
    return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)


def host_sampling(rows: int) -> SamplingArrays:
    """Greedy sampling arrays on the host (numpy), to be filled in per row."""
    return SamplingArrays(
        temperature=np.zeros(rows, np.float32),
        top_k=np.zeros(rows, np.int32),
        top_p=np.ones(rows, np.float32),
        seed=np.zeros(rows, np.uint32),
        step=np.zeros(rows, np.int32),
    )


def set_sampling(arrays: SamplingArrays, row: int, sampling: SamplingRow) -> None:
    """Row `row` of host sampling arrays takes `sampling`'s parameters."""
    arrays.temperature[row] = sampling.temperature
    arrays.top_k[row] = sampling.top_k
    arrays.top_p[row] = sampling.top_p
    arrays.seed[row] = sampling.seed
    arrays.step[row] = sampling.step
