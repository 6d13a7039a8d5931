"""Per-row sampling inside the jitted step: greedy, temperature, top-k, top-p, seed, and
the log-probabilities a row asks for.

Every row carries its own parameters as arrays, so one compiled step serves any mix
of requests. A row's random key is `fold_in(PRNGKey(seed), step)`, where step is the
number of tokens the request has generated so far: a request's samples depend on
its seed alone, never on what else is in the batch.

Log-probabilities are the model's (the log-softmax of its fp32 logits, before
temperature and the cuts, as vLLM's default `raw_logprobs`): of the token chosen and of
the `MAX_LOGPROBS` most likely tokens, at a fixed width so that no request's `logprobs`
recompiles a step. A batch in which no row asks skips them (`lax.cond`), as an
all-greedy batch skips the sort.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jlora.engine.api import MAX_LOGPROBS
from jlora.engine.device_api import LogprobArrays, SamplingRow
from jlora.model.sharding import to_host

Rows = jax.Array | np.ndarray  # numpy while the host fills it in, jax.Array inside the step


@struct.dataclass
class SamplingArrays:
    temperature: Rows  # f32[S]; 0 means greedy
    top_k: Rows  # i32[S]; 0 means no top-k cut
    top_p: Rows  # f32[S]; 1 means no nucleus cut
    seed: Rows  # u32[S]
    step: Rows  # i32[S]; tokens generated so far by the row's request
    logprobs: Rows  # bool[S]; the row's log-probabilities are wanted


@struct.dataclass
class TokenLogprobs:
    """Log-probabilities at each of S positions (zeros where none were computed)."""

    chosen: Rows  # f32[S]: of the token chosen there (sampled, or a prompt's next one)
    top_ids: Rows  # i32[S, K]: the K most likely tokens, most likely first
    top: Rows  # f32[S, K]: their log-probabilities


def sample(logits: jax.Array, params: SamplingArrays) -> tuple[jax.Array, TokenLogprobs]:
    """logits: f32[S, V] -> (i32[S], their log-probabilities). All-greedy batches skip the
    sort entirely; batches no row of which wants log-probabilities skip those."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    tokens = jax.lax.cond(
        jnp.all(params.temperature == 0.0),
        lambda: greedy,
        lambda: jnp.where(params.temperature == 0.0, greedy, _sample_rows(logits, params)),
    )
    wanted = jnp.any(params.logprobs)
    return tokens, jax.lax.cond(
        wanted, lambda: logprobs_of(logits, tokens), lambda: _no_logprobs(logits)
    )


def logprobs_of(logits: jax.Array, chosen: jax.Array) -> TokenLogprobs:
    """logits: f32[S, V]; chosen: i32[S] (a negative id: none, its log-probability 0)."""
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logprobs, jnp.maximum(chosen, 0)[:, None], axis=-1)[:, 0]
    top, top_ids = jax.lax.top_k(logprobs, _width(logits))
    return TokenLogprobs(jnp.where(chosen >= 0, picked, 0.0), top_ids.astype(jnp.int32), top)


def host_logprobs(logprobs: TokenLogprobs, rows: np.ndarray | slice = slice(None)) -> LogprobArrays:
    """A step's log-probabilities on the host, at positions `rows` (all by default)."""
    arrays = (logprobs.chosen, logprobs.top_ids, logprobs.top)
    chosen, top_ids, top = (a if isinstance(a, np.ndarray) else to_host(a) for a in arrays)
    return LogprobArrays(chosen, top_ids, top).take(rows)


def _no_logprobs(logits: jax.Array) -> TokenLogprobs:
    rows, width = logits.shape[0], _width(logits)
    return TokenLogprobs(
        jnp.zeros(rows, jnp.float32),
        jnp.zeros((rows, width), jnp.int32),
        jnp.zeros((rows, width), jnp.float32),
    )


def _width(logits: jax.Array) -> int:
    return min(MAX_LOGPROBS, logits.shape[-1])


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
        logprobs=np.zeros(rows, bool),
    )


def set_sampling(arrays: SamplingArrays, row: int, sampling: SamplingRow) -> None:
    """Row `row` of host sampling arrays takes `sampling`'s parameters."""
    arrays.temperature[row] = sampling.temperature
    arrays.top_k[row] = sampling.top_k
    arrays.top_p[row] = sampling.top_p
    arrays.seed[row] = sampling.seed
    arrays.step[row] = sampling.step
    arrays.logprobs[row] = sampling.logprobs
