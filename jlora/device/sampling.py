"""Per-row sampling inside the jitted step: the logit adjustments (logit bias, min_tokens,
repetition/frequency/presence penalties), greedy, temperature, min-p, top-k, top-p,
seed, and the log-probabilities a row asks for.

Every row carries its own parameters as arrays, so one compiled step serves any mix
of requests. A row's random key is `fold_in(PRNGKey(seed), step)`, where step is the
number of tokens the request has generated so far: a request's samples depend on
its seed alone, never on what else is in the batch.

The adjustments follow vLLM's order (SamplingParams says what each means). Their
arrays have fixed widths (`MAX_LOGIT_BIAS` biases, `BANNED_WIDTH` tokens banned before
min_tokens; id `PAD` fills a row's unused entries), and the penalties read each row's
tokens so far from `history` (i32[S, H]; PAD after the row's tokens; the last `step`
of them are its output): H is the step's own length (a decode bucket's tokens, a
prefill's context), so no request's controls recompile a step. A batch in which no
row adjusts its logits skips them (`lax.cond`).

Log-probabilities are the model's (the log-softmax of its fp32 logits, before
temperature and the cuts, as vLLM's default `raw_logprobs`): of the token chosen and of
the `MAX_LOGPROBS` most likely tokens, at a fixed width so that no request's `logprobs`
recompiles a step. A batch in which no row asks skips them (`lax.cond`), as an
all-greedy batch skips the sort.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jlora.engine.api import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_STOP_TOKEN_IDS
from jlora.engine.device_api import LogprobArrays, Prefilled, PrefillJob, SamplingRow
from jlora.model.sharding import to_host

Rows = jax.Array | np.ndarray  # numpy while the host fills it in, jax.Array inside the step
BANNED_WIDTH = MAX_STOP_TOKEN_IDS + 16  # a request's stop token ids and the model's EOS ids
PAD = 2**30  # an unused entry: an id past any vocabulary (its scatter is dropped)
SCORE_BLOCK = 256  # positions whose logits a scored prefill computes at a time
CANDIDATES = 256  # the most likely tokens a sampled row's cuts are looked for among first
BLOCK = 512  # entries per block of a draw's two-level inversion


@struct.dataclass
class SamplingArrays:
    temperature: Rows  # f32[S]; 0 means greedy
    top_k: Rows  # i32[S]; 0 means no top-k cut
    top_p: Rows  # f32[S]; 1 means no nucleus cut
    seed: Rows  # u32[S]
    step: Rows  # i32[S]; tokens generated so far by the row's request
    logprobs: Rows  # bool[S]; the row's log-probabilities are wanted
    presence: Rows  # f32[S]; 0: none
    frequency: Rows  # f32[S]; 0: none
    repetition: Rows  # f32[S]; 1: none
    min_p: Rows  # f32[S]; 0: none
    min_tokens: Rows  # i32[S]; `banned` cannot be sampled while step < min_tokens
    banned: Rows  # i32[S, BANNED_WIDTH]
    bias_ids: Rows  # i32[S, MAX_LOGIT_BIAS]
    bias: Rows  # f32[S, MAX_LOGIT_BIAS]
    history: Rows  # i32[S, H]: the row's tokens so far, then PAD (read for the penalties)
    allowed: Rows  # i32[S, ceil(V / 32)]: a grammar's bitmask of the next token (-1: any)
    constrained: Rows  # bool[S]: the row has a grammar


@struct.dataclass
class TokenLogprobs:
    """Log-probabilities at each of S positions (zeros where none were computed)."""

    chosen: Rows  # f32[S]: of the token chosen there (sampled, or a prompt's next one)
    top_ids: Rows  # i32[S, K]: the K most likely tokens, most likely first
    top: Rows  # f32[S, K]: their log-probabilities


def sample(logits: jax.Array, params: SamplingArrays) -> tuple[jax.Array, TokenLogprobs]:
    """logits: f32[S, V] -> (i32[S], their log-probabilities). Batches in which no row
    adjusts its logits skip the adjustments, all-greedy ones the sort, and those no row
    of which wants log-probabilities skip those."""
    adjusting = (
        jnp.any(params.constrained)
        | jnp.any(params.bias_ids < PAD)
        | jnp.any(params.step < params.min_tokens)
        | jnp.any(penalized(params))
    )
    adjusted = jax.lax.cond(adjusting, lambda: adjust(logits, params), lambda: logits)
    greedy = jnp.argmax(adjusted, axis=-1).astype(jnp.int32)
    tokens = jax.lax.cond(
        jnp.all(params.temperature == 0.0),
        lambda: greedy,
        lambda: jnp.where(params.temperature == 0.0, greedy, _sample_rows(adjusted, params)),
    )
    wanted = jnp.any(params.logprobs)
    return tokens, jax.lax.cond(
        wanted, lambda: logprobs_of(logits, tokens), lambda: _no_logprobs(logits)
    )


def penalized(params: SamplingArrays) -> jax.Array:
    """bool[S]: the rows a penalty applies to."""
    return (params.presence != 0.0) | (params.frequency != 0.0) | (params.repetition != 1.0)


def adjust(logits: jax.Array, params: SamplingArrays) -> jax.Array:
    """f32[S, V]: the logits after each row's grammar, logit bias, min_tokens ban and
    penalties."""
    rows, vocab = logits.shape
    row = jnp.arange(rows)[:, None]

    def grammar(logits: jax.Array) -> jax.Array:
        words = jnp.repeat(params.allowed, 32, axis=-1)
        bits = (words >> (jnp.arange(words.shape[-1], dtype=jnp.int32) % 32)[None, :]) & 1
        # logits padded past the vocabulary (a mesh's): those ids are never allowed
        bits = jnp.pad(bits, ((0, 0), (0, max(0, vocab - bits.shape[-1]))))[:, :vocab]
        return jnp.where(params.constrained[:, None] & (bits == 0), -jnp.inf, logits)

    logits = logits.astype(jnp.float32)
    logits = jax.lax.cond(jnp.any(params.constrained), grammar, lambda logits: logits, logits)
    logits = logits.at[row, params.bias_ids].add(params.bias, mode="drop")
    ban = jnp.where((params.step < params.min_tokens)[:, None], -jnp.inf, 0.0)
    logits = logits.at[row, params.banned].add(
        jnp.broadcast_to(ban, params.banned.shape), mode="drop"
    )

    def penalize(logits: jax.Array) -> jax.Array:
        history = params.history
        known = jnp.sum(history < PAD, axis=-1)
        output = jnp.arange(history.shape[1])[None, :] >= (known - params.step)[:, None]
        counts = jnp.zeros((rows, vocab), jnp.float32)
        counts = counts.at[row, history].add(output.astype(jnp.float32), mode="drop")
        seen = jnp.zeros((rows, vocab), bool).at[row, history].set(True, mode="drop")
        repetition = params.repetition[:, None]
        repeated = jnp.where(logits > 0, logits / repetition, logits * repetition)
        logits = jnp.where(seen, repeated, logits)
        return (
            logits
            - params.frequency[:, None] * counts
            - params.presence[:, None] * (counts > 0).astype(jnp.float32)
        )

    return jax.lax.cond(jnp.any(penalized(params)), penalize, lambda logits: logits, logits)


def logprobs_of(logits: jax.Array, chosen: jax.Array) -> TokenLogprobs:
    """logits: f32[S, V]; chosen: i32[S] (a negative id: none, its log-probability 0)."""
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logprobs, jnp.maximum(chosen, 0)[:, None], axis=-1)[:, 0]
    top, top_ids = jax.lax.top_k(logprobs, _width(logits))
    return TokenLogprobs(jnp.where(chosen >= 0, picked, 0.0), top_ids.astype(jnp.int32), top)


def block_scores(
    logits: Callable[[jax.Array], jax.Array], x: jax.Array, targets: jax.Array
) -> TokenLogprobs:
    """Every position's log-probabilities (targets[i] chosen at position i) from its
    hidden state x[i], `logits` applied SCORE_BLOCK positions at a time: a long prompt's
    [T, V] logits are never whole."""
    length = x.shape[0]
    block = SCORE_BLOCK if length % SCORE_BLOCK == 0 else length
    blocks = (x.reshape(length // block, block, -1), targets.reshape(length // block, block))
    scores = jax.lax.map(lambda b: logprobs_of(logits(b[0]), b[1]), blocks)
    return jax.tree.map(lambda a: a.reshape(length, *a.shape[2:]), scores)


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
    """A token per row from its distribution at its temperature, among the tokens its
    cuts keep (`kept`)."""
    scaled, top, ids, floor, inside = _cuts(logits, params)
    keys = jax.vmap(lambda seed, step: jax.random.fold_in(jax.random.PRNGKey(seed), step))(
        params.seed, params.step
    )

    def among_candidates() -> jax.Array:
        choice = _draw(keys, jnp.where(top >= floor[:, None], top, -jnp.inf))
        return jnp.take_along_axis(ids, choice[:, None], axis=-1)[:, 0]

    def over_the_vocabulary() -> jax.Array:
        return _draw(keys, jnp.where(scaled >= floor[:, None], scaled, -jnp.inf))

    return jax.lax.cond(inside, among_candidates, over_the_vocabulary).astype(jnp.int32)


def _draw(keys: jax.Array, logits: jax.Array) -> jax.Array:
    """i32[S]: an index per row drawn from softmax(logits) (-inf: never) by inverting its
    cumulative distribution at one uniform number, block by block: a block of BLOCK
    entries first, then the entry within it (two short scans, not one over the row)."""
    rows, width = logits.shape
    block = min(BLOCK, width)
    pad = -width % block
    probs = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
    probs = jnp.pad(probs, ((0, 0), (0, pad))).reshape(rows, -1, block)
    masses = jnp.sum(probs, axis=-1)  # [S, blocks]
    ends = jnp.cumsum(masses, axis=-1)
    u = jax.vmap(jax.random.uniform)(keys) * ends[:, -1]
    which = _first_above(ends, u, masses > 0)
    inner = jnp.take_along_axis(probs, which[:, None, None], axis=1)[:, 0]  # [S, block]
    before = jnp.take_along_axis(ends - masses, which[:, None], axis=-1)[:, 0]
    at = _first_above(before[:, None] + jnp.cumsum(inner, axis=-1), u, inner > 0)
    return which * block + at


def _first_above(ends: jax.Array, u: jax.Array, possible: jax.Array) -> jax.Array:
    """i32[S]: per row, the first position whose running total passes u, kept to the
    last possible one (rounding never picks an impossible entry)."""
    first = jnp.sum(ends <= u[:, None], axis=-1)
    positions = jnp.arange(ends.shape[-1])
    last = jnp.max(jnp.where(possible, positions, 0), axis=-1)
    return jnp.minimum(first, last).astype(jnp.int32)


def kept(logits: jax.Array, params: SamplingArrays) -> jax.Array:
    """bool[S, V]: the tokens each row may sample: min-p's (relative to the most likely),
    then top-k's (ties with the k-th kept, as transformers' and vLLM's), then top-p's on
    the distribution those leave, renormalised (the fewest most likely tokens holding
    top_p of it)."""
    scaled, _, _, floor, _ = _cuts(logits, params)
    return scaled >= floor[:, None]


def _cuts(logits: jax.Array, params: SamplingArrays) -> tuple[jax.Array, ...]:
    """(scaled logits f32[S, V], the CANDIDATES most likely (f32[S, C], their ids),
    each row's floor f32[S] (the least kept scaled logit), whether every row's kept
    tokens are among the candidates). The floor is looked for among the candidates
    first; only where a sampled row's cuts reach beyond them (no cut at all, a wide
    nucleus) over the whole vocabulary, by bisection: no step sorts the vocabulary."""
    vocab = logits.shape[-1]
    temperature = jnp.where(params.temperature > 0, params.temperature, 1.0)
    scaled = logits / temperature[:, None]
    top, ids = jax.lax.top_k(scaled, min(CANDIDATES, vocab))
    floor, fits = _candidate_floor(scaled, top, params)
    fits |= params.temperature == 0.0  # a greedy row's draw is not used
    inside = jnp.all(fits)
    floor = jax.lax.cond(
        inside, lambda: floor, lambda: jnp.where(fits, floor, _vocabulary_floor(scaled, params))
    )
    return scaled, top, ids, floor, inside


def _candidate_floor(
    scaled: jax.Array, top: jax.Array, params: SamplingArrays
) -> tuple[jax.Array, jax.Array]:
    """(f32[S]: the least kept token's scaled logit, bool[S]: whether every kept token is
    among the candidates `top` (f32[S, C], most likely first), so that floor is exact)."""
    vocab, width = scaled.shape[-1], top.shape[-1]
    rank = jnp.arange(width)[None, :]
    top_k = jnp.where(params.top_k > 0, params.top_k, vocab)
    # `top` is read whole, never sliced: XLA:CPU's fast top-k is then kept (a slice of
    # it beside another use turns it into a sort of the whole row, ~40x slower).
    most = jnp.max(scaled, axis=-1, keepdims=True)
    lowest = most + jnp.log(params.min_p)[:, None]  # min-p's bound (-inf: none)
    keep = (rank < top_k[:, None]) & (top >= lowest)
    cut_inside = (top_k <= width) | (jnp.min(top, axis=-1) < lowest[:, 0])
    normaliser = jax.nn.logsumexp(scaled, axis=-1, keepdims=True)
    probs = jnp.where(keep, jnp.exp(top - normaliser), 0.0)
    outside = jnp.sum(jnp.where(scaled >= lowest, jnp.exp(scaled - normaliser), 0.0), axis=-1)
    probs /= jnp.where(cut_inside, jnp.sum(probs, axis=-1), outside)[:, None]
    mass = jnp.cumsum(probs, axis=-1)
    keep &= (mass - probs < params.top_p[:, None]) | (rank == 0)
    nucleus_inside = (params.top_p < 1.0) & (mass[:, -1] >= params.top_p)
    floor = jnp.min(jnp.where(keep, top, jnp.inf), axis=-1)
    return floor, cut_inside | nucleus_inside


def _vocabulary_floor(scaled: jax.Array, params: SamplingArrays) -> jax.Array:
    """f32[S]: each row's floor over the whole vocabulary, by bisection over the scaled
    logits' order-preserving integer keys (exact: every float is a key)."""
    vocab = scaled.shape[-1]
    keys = _order_keys(scaled)
    lowest = jnp.max(scaled, axis=-1) + jnp.log(params.min_p)
    bound = _order_keys(lowest)
    top_k = jnp.where(params.top_k > 0, params.top_k, vocab)

    def kth() -> jax.Array:  # the largest key that top_k tokens reach
        return _largest(keys, lambda b: jnp.sum(keys >= b[:, None], axis=-1) >= top_k)

    bound = jax.lax.cond(
        jnp.any(params.top_k > CANDIDATES), lambda: jnp.maximum(bound, kth()), lambda: bound
    )
    probs = jnp.where(keys >= bound[:, None], jax.nn.softmax(scaled, axis=-1), 0.0)
    needed = params.top_p * jnp.sum(probs, axis=-1)

    def nucleus() -> jax.Array:  # the largest key whose tokens and above hold top_p
        mass = lambda b: jnp.sum(jnp.where(keys >= b[:, None], probs, 0.0), axis=-1)  # noqa: E731
        return jnp.where(
            params.top_p < 1.0,
            jnp.maximum(bound, _largest(keys, lambda b: mass(b) >= needed)),
            bound,
        )

    floor = jax.lax.cond(jnp.any(params.top_p < 1.0), nucleus, lambda: bound)
    return _from_order_keys(floor)


def _order_keys(x: jax.Array) -> jax.Array:
    """u32 keys in the order of the floats x (-inf lowest)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _from_order_keys(keys: jax.Array) -> jax.Array:
    bits = jnp.where(keys >> 31 == 1, keys & jnp.uint32(0x7FFFFFFF), ~keys)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _largest(keys: jax.Array, enough) -> jax.Array:  # type: ignore[no-untyped-def]
    """u32[S]: per row, the largest key b among keys' range with enough(b) (a predicate
    true at the row's least key and falling as b grows)."""
    lo, hi = jnp.min(keys, axis=-1), jnp.max(keys, axis=-1)

    def halve(_: int, bounds: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        lo, hi = bounds
        mid = lo + (hi - lo) // 2 + (hi - lo) % 2
        ok = enough(mid)
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    return jax.lax.fori_loop(0, 33, halve, (lo, hi))[0]


def host_sampling(rows: int, history: int, vocab: int) -> SamplingArrays:
    """Greedy sampling arrays on the host (numpy) for `rows` rows with `history` tokens
    of history each, over `vocab` tokens, to be filled in per row."""
    return SamplingArrays(
        temperature=np.zeros(rows, np.float32),
        top_k=np.zeros(rows, np.int32),
        top_p=np.ones(rows, np.float32),
        seed=np.zeros(rows, np.uint32),
        step=np.zeros(rows, np.int32),
        logprobs=np.zeros(rows, bool),
        presence=np.zeros(rows, np.float32),
        frequency=np.zeros(rows, np.float32),
        repetition=np.ones(rows, np.float32),
        min_p=np.zeros(rows, np.float32),
        min_tokens=np.zeros(rows, np.int32),
        banned=np.full((rows, BANNED_WIDTH), PAD, np.int32),
        bias_ids=np.full((rows, MAX_LOGIT_BIAS), PAD, np.int32),
        bias=np.zeros((rows, MAX_LOGIT_BIAS), np.float32),
        history=np.full((rows, history), PAD, np.int32),
        allowed=np.full((rows, -(-vocab // 32)), -1, np.int32),
        constrained=np.zeros(rows, bool),
    )


def set_sampling(
    arrays: SamplingArrays, row: int, sampling: SamplingRow, history: Sequence[int] = ()
) -> None:
    """Row `row` of host sampling arrays takes `sampling`'s parameters and, where a
    penalty reads them, the tokens of `history` (the row's so far)."""
    arrays.temperature[row] = sampling.temperature
    arrays.top_k[row] = sampling.top_k
    arrays.top_p[row] = sampling.top_p
    arrays.seed[row] = sampling.seed
    arrays.step[row] = sampling.step
    arrays.logprobs[row] = sampling.logprobs
    arrays.presence[row] = sampling.presence
    arrays.frequency[row] = sampling.frequency
    arrays.repetition[row] = sampling.repetition
    arrays.min_p[row] = sampling.min_p
    arrays.min_tokens[row] = sampling.min_tokens
    if len(sampling.banned) > BANNED_WIDTH:
        raise ValueError(f"{len(sampling.banned)} banned tokens: at most {BANNED_WIDTH}")
    arrays.banned[row] = PAD
    arrays.banned[row, : len(sampling.banned)] = sampling.banned
    arrays.bias_ids[row] = PAD
    arrays.bias[row] = 0.0
    for i, (token, bias) in enumerate(sampling.logit_bias):
        arrays.bias_ids[row, i], arrays.bias[row, i] = token, bias
    arrays.history[row] = PAD
    if sampling.penalized:
        arrays.history[row, : len(history)] = history
    constrain(arrays, row, sampling.allowed)


def constrain(arrays: SamplingArrays, row: int, allowed: np.ndarray | None) -> None:
    """Row `row`'s next token is one of `allowed` (a grammar's bitmask); None: any."""
    arrays.allowed[row] = -1 if allowed is None else allowed
    arrays.constrained[row] = allowed is not None


def prefill_outputs(job: PrefillJob, head: Sequence, skip: int = 0) -> Prefilled:
    """A prefill step's outputs on the host: (the first token, its log-probabilities (one
    position)[, every position's]); the positions' scores from `skip` on (where the step
    computed a cached prefix again) and not past the job's computed tokens."""
    token, logprobs, *scores = head
    first = host_logprobs(logprobs) if job.sampling.logprobs else None
    prompt = None
    if scores:
        prompt = host_logprobs(scores[0], slice(skip, skip + len(job.tokens) - job.cached))
    return Prefilled(int(to_host(token)), logprobs=first, prompt=prompt)
