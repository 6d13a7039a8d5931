"""Paged decode attention: the naive reference on a hand-worked case, then the Pallas
kernel against it (and against the model's XLA attention) over GQA groups, block sizes,
positions at and across block edges and idle rows, compiled and in interpret mode; the
kernel lowered for CUDA on the CPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.common import KernelArgumentError
from pallas_kernels.decode_attention import decode_attention, decode_attention_reference
from tests import kernel_cases
from tests.tolerances import assert_close


def test_reference_tiny_case():
    # One row, one head, d = 2, blocks of 2; its tokens 0, 1 in block 1, token 2 in block 0.
    k = np.zeros((2, 2, 1, 2), np.float32)
    v = np.zeros((2, 2, 1, 2), np.float32)
    k[1, 0, 0], k[1, 1, 0], k[0, 0, 0] = [1, 0], [0, 1], [1, 1]
    v[1, 0, 0], v[1, 1, 0], v[0, 0, 0] = [1, 0], [0, 1], [2, 2]
    tables = np.array([[1, 0], [1, 0]], np.int32)
    positions = np.array([2, 0], np.int32)
    q = np.zeros((2, 1, 2), np.float32)
    # q = 0: every visible token weighs the same; row 0 sees three: ([1,0]+[0,1]+[2,2])/3
    # = [1, 1]; row 1 sees token 0 alone: [1, 0].
    out = decode_attention_reference(q, k, v, tables, positions)
    np.testing.assert_allclose(out, [[[1, 1]], [[1, 0]]], atol=1e-12)


def _case(rng, *, rows, heads, kv_heads, head_dim, block_size, dtype):
    """A random cache of rows' blocks (permuted through their tables), each row at its own
    position: 0, a block's last token, the next block's first, the longest; an idle
    row (the sentinel table, position 0) last."""
    max_blocks = 4
    num_blocks = rows * max_blocks
    k = rng.normal(size=(num_blocks, block_size, kv_heads, head_dim))
    v = rng.normal(size=(num_blocks, block_size, kv_heads, head_dim))
    q = rng.normal(size=(rows, heads, head_dim)) * 2.0
    tables = rng.permutation(num_blocks).reshape(rows, max_blocks).astype(np.int32)
    edges = [0, block_size - 1, block_size, 2 * block_size + 3, max_blocks * block_size - 1]
    positions = np.array([edges[r % len(edges)] for r in range(rows)], np.int32)
    tables[-1], positions[-1] = num_blocks, 0  # idle: clamped into the cache
    cast = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    return cast(q), cast(k), cast(v), jnp.asarray(tables), jnp.asarray(positions)


SHAPES = [  # (heads, kv_heads, head_dim, block_size): MHA (Llama 2), GQA 2 and 4 (Llama 3)
    (4, 4, 16, 4), (4, 2, 16, 16), (8, 2, 32, 16), (4, 1, 64, 8),
]  # fmt: skip


class TestDecodeAttention:
    INTERPRET = False

    @pytest.fixture(autouse=True)
    def _device(self):
        kernel_cases.gpu_or_skip(self.INTERPRET)

    @pytest.mark.parametrize("dtype", kernel_cases.DTYPES)
    @pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), SHAPES)
    def test_equals_the_reference(self, heads, kv_heads, head_dim, block_size, dtype):
        rng = np.random.default_rng(heads * 7 + kv_heads + block_size)
        args = _case(rng, rows=7, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                     block_size=block_size, dtype=dtype)  # fmt: skip
        out = decode_attention(*args, interpret=self.INTERPRET)
        assert_close(out, decode_attention_reference(*args), dtype, dtype, scope="op")

    @pytest.mark.parametrize("dtype", kernel_cases.DTYPES)
    def test_equals_the_models_attention(self, dtype):
        from jlora.model.attention import paged_decode_attention

        rng = np.random.default_rng(3)
        args = _case(rng, rows=5, heads=8, kv_heads=2, head_dim=32, block_size=16, dtype=dtype)
        out = decode_attention(*args, interpret=self.INTERPRET)
        theirs = paged_decode_attention(*args).reshape(out.shape)
        assert_close(out[:-1], theirs[:-1], dtype, dtype, scope="op")  # the idle row aside


class TestDecodeAttentionInterpret(TestDecodeAttention):
    INTERPRET = True


def test_argument_errors_name_the_argument():
    rng = np.random.default_rng(0)
    q, k, v, tables, positions = _case(rng, rows=2, heads=6, kv_heads=2, head_dim=16,
                                       block_size=4, dtype=jnp.float32)  # fmt: skip
    with pytest.raises(KernelArgumentError, match="heads // kv_heads=3 must be a power of two"):
        decode_attention(q, k, v, tables, positions, interpret=True)
    with pytest.raises(KernelArgumentError, match="^v_pages has dtype"):
        decode_attention(q[:, :4], k, v.astype(jnp.bfloat16), tables, positions, interpret=True)
    with pytest.raises(KernelArgumentError, match="^positions has shape"):
        decode_attention(q[:, :4], k, v, tables, positions[:1], interpret=True)


def test_the_kernel_lowers_for_cuda():
    rng = np.random.default_rng(1)
    args = _case(rng, rows=4, heads=32, kv_heads=8, head_dim=128, block_size=16,
                 dtype=jnp.bfloat16)  # fmt: skip
    lowered = jax.jit(decode_attention).trace(*args).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert "__gpu$xla.gpu.triton" in text and 'name = "decode_attention"' in text


def test_an_engine_decodes_the_same_tokens_with_the_kernel(monkeypatch):
    """cpu-tiny (GQA, 2 query heads per KV head) through the engine: the kernel's decode
    (interpreted here, traced into each decode step) gives XLA's greedy
    tokens, rows of several lengths side by side; a model whose shapes the kernel cannot
    take is refused when the engine is built."""
    import dataclasses

    from jlora.engine.api import SamplingParams
    from jlora.model import llama

    traced = []
    kernel = llama.paged_decode_attention_kernel
    monkeypatch.setattr(
        llama, "paged_decode_attention_kernel", lambda *a: traced.append(1) or kernel(*a)
    )
    from jlora.model.loading import load_model
    from tests.engine_helpers import make_engine, run_to_completion

    loaded = load_model("cpu-tiny")
    prompts = [list(range(1, 1 + n)) for n in (3, 17, 30)]
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    tokens = {}
    for kind in ("xla", "pallas"):
        engine = make_engine(loaded, max_slots=4, max_seq_len=64, decode_attention=kind)
        try:
            tokens[kind] = [r["token_ids"] for r in run_to_completion(engine, prompts, greedy)]
        finally:
            engine.close()
    assert tokens["pallas"] == tokens["xla"]
    assert traced  # the decode steps compiled the kernel in
    odd = dataclasses.replace(loaded, config=dataclasses.replace(loaded.config, num_heads=6,
                                                                  num_kv_heads=2))  # fmt: skip
    with pytest.raises(ValueError, match="decode_attention='pallas'.*heads // kv_heads=3"):
        make_engine(odd, max_slots=4, max_seq_len=64, decode_attention="pallas")
