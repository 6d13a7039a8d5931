"""The three weight loaders (Hugging Face safetensors, orbax checkpoint, GGUF) and their errors.

The Hugging Face case is checked against transformers itself: a tiny random
`LlamaForCausalLM` is saved with `save_pretrained`, loaded by jlora, and both models
give the same last-position logits. Its weights are drawn with std 0.2 rather than
transformers' default 0.02: at 0.02 the attention barely moves the logits, and a
wrong RoPE frequency changes them by less than the fp32 tolerance (measured: 2e-4 at
0.02, ~3 at 0.2), so the comparison would not catch it.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jlora.cli.main import main
from jlora.model.checkpoint import MARKER
from jlora.model.gguf import dequantize, unpermute_rope_rows
from jlora.model.loading import load_model
from jlora.model.weights import WeightsError
from tests.model_helpers import TINY_HF, hf_last_logits, jlora_last_logits
from tests.tolerances import assert_close

# 1 token, within one KV block, across a block boundary (16), across two.
SEQUENCE_LENGTHS = (1, 7, 17, 40)


def _save_tiny_hf(path, *, tie: bool, rope_theta: float = 10000.0):
    """A random tiny Llama saved as a Hugging Face directory; returns the torch model."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**TINY_HF, rope_theta=rope_theta, tie_word_embeddings=tie)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path)  # safetensors by default
    assert list(path.glob("*.safetensors")), "save_pretrained wrote no safetensors file"
    return model


# -- Hugging Face safetensors directory ------------------------------------------------


@pytest.mark.parametrize(
    ("tie", "rope_theta"),
    [
        (True, 10000.0),
        (False, 10000.0),
        (False, 500000.0),  # transformers 5 writes it inside config.json's rope_parameters
    ],
)
def test_hf_directory_logits_match_transformers(tmp_path, tie, rope_theta):
    hf_model = _save_tiny_hf(tmp_path, tie=tie, rope_theta=rope_theta)
    loaded = load_model(str(tmp_path))

    assert loaded.config.num_kv_heads == 2 and loaded.config.num_layers == 2
    assert loaded.config.tie_embeddings is tie
    assert ("lm_head" in loaded.params) is not tie
    assert loaded.config.rope_theta == rope_theta
    rng = np.random.default_rng(0)
    for length in SEQUENCE_LENGTHS:
        ids = rng.integers(0, TINY_HF["vocab_size"], length).tolist()
        assert_close(
            jlora_last_logits(loaded, ids),
            hf_last_logits(hf_model, ids),
            jnp.float32,
            np.float32,
            scope="model",
        )


@pytest.fixture
def hf_tiny_dir(tmp_path):
    directory = tmp_path / "hf"
    _save_tiny_hf(directory, tie=False)
    return directory


def _edit_safetensors(directory, edit) -> None:
    """Rewrite the directory's one safetensors file as edit(tensors) returns it."""
    from safetensors.numpy import load_file, save_file

    (file,) = directory.glob("*.safetensors")
    save_file(edit(load_file(file)), file, metadata={"format": "pt"})


def _shrink_k_proj(tensors):
    tensors["model.layers.1.self_attn.k_proj.weight"] = tensors[
        "model.layers.1.self_attn.k_proj.weight"
    ][:16]  # [32, 64] -> [16, 64]
    return tensors


def _drop_down_proj(tensors):
    del tensors["model.layers.0.mlp.down_proj.weight"]
    return tensors


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (_shrink_k_proj, ["tensor model.layers.1.self_attn.k_proj.weight", "(16, 64)", "(32, 64)"]),
        (_drop_down_proj, ["tensor model.layers.0.mlp.down_proj.weight is missing"]),
    ],
    ids=["wrong-shape", "missing"],
)
def test_hf_directory_with_a_bad_tensor_names_it(hf_tiny_dir, edit, expected):
    _edit_safetensors(hf_tiny_dir, edit)
    with pytest.raises(WeightsError) as raised:
        load_model(str(hf_tiny_dir))
    for fragment in expected:
        assert fragment in str(raised.value)


def test_hf_directory_with_a_corrupt_safetensors_file(hf_tiny_dir):
    (file,) = hf_tiny_dir.glob("*.safetensors")
    file.write_bytes(file.read_bytes()[:100])
    with pytest.raises(WeightsError, match="cannot read safetensors"):
        load_model(str(hf_tiny_dir))


# -- orbax checkpoint (`jlora convert`) ------------------------------------------------


@pytest.fixture
def no_compilation_cache(monkeypatch):
    """main() would point this process's XLA cache at ~/.cache; an empty value turns it off."""
    monkeypatch.setenv("JLORA_COMPILATION_CACHE", "")


@pytest.mark.usefixtures("no_compilation_cache")
@pytest.mark.parametrize("preset", ["cpu-tiny", "cpu-tiny-tied"])
def test_convert_round_trips_params_and_config_exactly(tmp_path, preset):
    out = tmp_path / "checkpoint"
    assert main(["convert", "--model", preset, "--out", str(out)]) == 0
    assert (out / MARKER).is_file()

    original, restored = load_model(preset), load_model(str(out))
    assert restored.config == original.config
    assert restored.tokenizer is None and original.tokenizer is None
    assert jax.tree.structure(restored.params) == jax.tree.structure(original.params)
    for (path, ours), theirs in zip(
        jax.tree.leaves_with_path(restored.params), jax.tree.leaves(original.params), strict=True
    ):
        assert ours.dtype == theirs.dtype == jnp.float32, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(
            np.asarray(ours), np.asarray(theirs), err_msg=jax.tree_util.keystr(path)
        )


@pytest.mark.usefixtures("no_compilation_cache")
@pytest.mark.parametrize("occupant", ["file-inside", "is-a-file"])
def test_convert_refuses_an_occupied_out_path(tmp_path, capsys, occupant):
    out = tmp_path / "out"
    if occupant == "file-inside":
        out.mkdir()
        (out / "keep.txt").write_text("precious")
    else:
        out.write_text("precious")
    before = sorted(p.name for p in tmp_path.rglob("*"))

    assert main(["convert", "--model", "cpu-tiny", "--out", str(out)]) == 2

    err = capsys.readouterr().err
    assert err.startswith("jlora: error: --out ") and str(out) in err, err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
    assert (out / "keep.txt" if out.is_dir() else out).read_text() == "precious"


@pytest.mark.slow
@pytest.mark.usefixtures("no_compilation_cache")
def test_convert_smollm2_keeps_its_tokenizer(tmp_path, smollm2):
    out = tmp_path / "smollm2"
    assert (
        main(["convert", "--model", "smollm2-135m", "--out", str(out), "--dtype", "bfloat16"]) == 0
    )
    restored = load_model(str(out), jnp.bfloat16)

    assert restored.config == smollm2.config
    assert jax.tree.leaves(restored.params)[0].dtype == jnp.bfloat16
    before, after = smollm2.tokenizer, restored.tokenizer
    assert after is not None
    assert (after.bos_id, after.eos_ids, after.add_bos, after.chat_template) == (
        before.bos_id,
        before.eos_ids,
        before.add_bos,
        before.chat_template,
    )
    assert after.vocab_size == before.vocab_size
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Ünïcode, digits 12345 and\ttabs — what is 2+2?"},
    ]
    prompt = before.apply_chat_template(messages)
    assert after.apply_chat_template(messages) == prompt
    ids = before.encode(prompt)
    assert after.encode(prompt) == ids
    assert after.decode(ids) == before.decode(ids)


# -- GGUF and model resolution ---------------------------------------------------------


def _random_bytes(_real: bytes) -> bytes:
    return np.random.default_rng(0).bytes(4096)


@pytest.mark.parametrize(
    "make",
    [
        _random_bytes,
        lambda real: b"",
        lambda real: real[:8],  # magic + version, then nothing
        lambda real: real[:1024],  # inside the metadata
        lambda real: real[:3_000_000],  # metadata whole, tensor data cut short
    ],
    ids=["random", "empty", "8-bytes", "1KiB", "3MB"],
)
def test_malformed_gguf_is_not_a_valid_gguf(tmp_path, smollm2_gguf_path, make):
    with smollm2_gguf_path.open("rb") as real:
        head = real.read(3_000_000)
    path = tmp_path / "broken.gguf"
    path.write_bytes(make(head))
    with pytest.raises(WeightsError, match="not a valid GGUF file") as raised:
        load_model(str(path))
    assert str(path) in str(raised.value)


def test_unknown_preset_lists_the_presets():
    with pytest.raises(WeightsError) as raised:
        load_model("no-such-preset")
    message = str(raised.value)
    assert "'no-such-preset'" in message
    for preset in ("cpu-tiny", "smollm2-135m"):
        assert preset in message


@pytest.mark.parametrize(
    "contents",
    [{}, {"README.md": "hello"}, {"model.bin": "weights"}],
    ids=["empty", "readme", "bin"],
)
def test_directory_that_is_no_model_is_refused(tmp_path, contents):
    for name, text in contents.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(WeightsError) as raised:
        load_model(str(tmp_path))
    message = str(raised.value)
    assert str(tmp_path) in message
    for expected in (".gguf", "config.json", MARKER):
        assert expected in message


def test_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(b"\0" * 64)
    with pytest.raises(WeightsError, match="neither a .gguf file"):
        load_model(str(path))


def _llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf `permute`, written naively.

    Per head of d rows, Hugging Face order read as [2, d/2] (half j, index i) is
    written as [d/2, 2]: row j*d/2 + i of the head moves to row 2*i + j.
    """
    head_dim = weight.shape[0] // heads
    half = head_dim // 2
    permuted = np.empty_like(weight)
    for head in range(heads):
        base = head * head_dim
        for j in range(2):
            for i in range(half):
                permuted[base + 2 * i + j] = weight[base + j * half + i]
    return permuted


def test_llama_cpp_permutation_by_hand():
    # One head, d=4: rows [[0, 1], [2, 3]] as [2, d/2], swapped to [[0, 2], [1, 3]].
    assert _llama_cpp_permute(np.arange(4), 1).tolist() == [0, 2, 1, 3]
    # Two heads, d=4: each head on its own.
    assert _llama_cpp_permute(np.arange(8), 2).tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    # One head, d=6: (0, 1, 2 | 3, 4, 5) interleaved.
    assert _llama_cpp_permute(np.arange(6), 1).tolist() == [0, 3, 1, 4, 2, 5]
    assert unpermute_rope_rows(np.array([0, 2, 1, 3, 4, 6, 5, 7]), 2).tolist() == list(range(8))


@pytest.mark.parametrize(
    ("heads", "head_dim", "in_features"), [(1, 4, None), (2, 8, 3), (4, 16, 5), (3, 64, 2)]
)
def test_unpermute_rope_rows_inverts_llama_cpp(heads, head_dim, in_features):
    shape = (heads * head_dim,) if in_features is None else (heads * head_dim, in_features)
    weight = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    permuted = _llama_cpp_permute(weight, heads)
    assert not np.array_equal(permuted, weight)
    restored = unpermute_rope_rows(permuted, heads)
    assert restored.dtype == weight.dtype
    np.testing.assert_array_equal(restored, weight)


# -- a GGUF file of our own making ---------------------------------------------------

# Hugging Face layer tensor -> (GGUF name, storage type): a mix of the types real files use.
_GGUF_LAYER_TENSORS = {
    "input_layernorm": ("attn_norm", "F32"),
    "self_attn.q_proj": ("attn_q", "Q8_0"),
    "self_attn.k_proj": ("attn_k", "F16"),
    "self_attn.v_proj": ("attn_v", "Q8_0"),
    "self_attn.o_proj": ("attn_output", "F16"),
    "post_attention_layernorm": ("ffn_norm", "F32"),
    "mlp.gate_proj": ("ffn_gate", "Q8_0"),
    "mlp.up_proj": ("ffn_up", "F32"),
    "mlp.down_proj": ("ffn_down", "Q8_0"),
}


def _write_gguf(path, hf_model) -> None:
    """Write a Hugging Face Llama as llama.cpp's converter would (q/k rows permuted)."""
    import gguf

    cfg = hf_model.config
    state = {k: v.detach().numpy() for k, v in hf_model.state_dict().items()}
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    writer.add_token_types([1] * cfg.vocab_size)
    writer.add_token_merges([])

    def add(name: str, array: np.ndarray, kind: str) -> None:
        qtype = gguf.GGMLQuantizationType[kind]
        if kind == "F16":
            array = array.astype(np.float16)
        elif kind != "F32":
            array = gguf.quants.quantize(array.astype(np.float32), qtype)
        writer.add_tensor(name, array, raw_dtype=qtype)

    add("token_embd.weight", state["model.embed_tokens.weight"], "Q8_0")
    add("output_norm.weight", state["model.norm.weight"], "F32")
    add("output.weight", state["lm_head.weight"], "F16")
    for i in range(cfg.num_hidden_layers):
        for hf_name, (gguf_name, kind) in _GGUF_LAYER_TENSORS.items():
            weight = state[f"model.layers.{i}.{hf_name}.weight"]
            if hf_name == "self_attn.q_proj":
                weight = _llama_cpp_permute(weight, cfg.num_attention_heads)
            elif hf_name == "self_attn.k_proj":
                weight = _llama_cpp_permute(weight, cfg.num_key_value_heads)
            add(f"blk.{i}.{gguf_name}.weight", weight, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_of_our_own_making_matches_transformers_reading_it(tmp_path):
    """Untied head, GQA, Q8_0/F16/F32 tensors: jlora and transformers read the same GGUF."""
    import torch
    from transformers import AutoModelForCausalLM

    hf_model = _save_tiny_hf(tmp_path / "hf", tie=False, rope_theta=50000.0)
    _write_gguf(tmp_path / "tiny.gguf", hf_model)
    loaded = load_model(str(tmp_path / "tiny.gguf"))
    assert loaded.config.rope_theta == 50000.0 and not loaded.config.tie_embeddings
    oracle = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file="tiny.gguf", dtype=torch.float32
    ).eval()
    rng = np.random.default_rng(1)
    for length in SEQUENCE_LENGTHS:
        ids = rng.integers(0, TINY_HF["vocab_size"], length).tolist()
        ours = jlora_last_logits(loaded, ids)
        assert_close(ours, hf_last_logits(oracle, ids), jnp.float32, np.float32, scope="model")
        # Quantization moved the weights; a permutation bug would move the logits more.
        assert np.abs(ours - hf_last_logits(hf_model, ids)).max() < 0.5


def test_the_baselines_copy_of_transformers_reading_is_made_once_and_equals_it(
    tmp_path, monkeypatch
):
    """bench.baselines.hf_model: the saved conversion holds transformers' own tensors; a
    second load reads the copy; a changed file gets a conversion of its own. (Its
    tokenizer is checked against jlora's in test_tokenizer.py: this file's has none that
    transformers reads.)"""
    import torch
    from transformers import AutoModelForCausalLM

    from bench.baselines import hf_model

    monkeypatch.setattr(hf_model, "CACHE", tmp_path / "cache")
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, _save_tiny_hf(tmp_path / "hf", tie=False))
    direct = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32
    ).state_dict()
    copy = hf_model.model(path).state_dict()
    assert copy.keys() == direct.keys()
    assert all(torch.equal(copy[name], direct[name]) for name in direct)

    def no_conversion(*args):
        raise AssertionError("converted again")

    monkeypatch.setitem(hf_model._SAVE, "model", no_conversion)
    again = hf_model.model(path, torch.bfloat16).state_dict()
    assert all(torch.equal(again[name], direct[name].bfloat16()) for name in direct)
    first = hf_model.converted(path, "model")
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1))
    with pytest.raises(AssertionError, match="converted again"):
        hf_model.converted(path, "model")
    assert first.is_dir()


def _reference_gguf(path):
    """The `gguf` package's own reader: metadata values and dequantized tensors."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    tensors = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in reader.tensors}
    return fields, tensors


def _assert_reads_like_the_gguf_package(path, tensor_names=None):
    from jlora.model.gguf import GGUFFile

    ours = GGUFFile(path)
    fields, tensors = _reference_gguf(path)
    assert ours.fields == fields
    for name in tensor_names or tensors:
        np.testing.assert_array_equal(
            ours.tensor(name), tensors[name].reshape(ours.tensor(name).shape)
        )


def test_gguf_reader_agrees_with_the_gguf_package_on_our_file(tmp_path):
    _write_gguf(tmp_path / "tiny.gguf", _save_tiny_hf(tmp_path / "hf", tie=False))
    _assert_reads_like_the_gguf_package(tmp_path / "tiny.gguf")


@pytest.mark.slow
def test_gguf_reader_agrees_with_the_gguf_package_on_smollm2(smollm2_gguf_path):
    names = ["token_embd.weight", "blk.0.attn_q.weight", "blk.29.ffn_down.weight",
             "output_norm.weight"]  # fmt: skip
    _assert_reads_like_the_gguf_package(smollm2_gguf_path, names)


def test_every_truncation_of_a_gguf_is_refused_cleanly(tmp_path):
    from jlora.model.gguf import GGUFFile

    _write_gguf(tmp_path / "tiny.gguf", _save_tiny_hf(tmp_path / "hf", tie=False))
    whole = (tmp_path / "tiny.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    for length in np.linspace(0, len(whole) - 1, 40, dtype=int):
        cut.write_bytes(whole[:length])
        with pytest.raises(WeightsError, match="not a valid GGUF file"):
            GGUFFile(cut)


@pytest.mark.slow
def test_tokenizer_larger_than_the_embedding_is_refused(tmp_path, smollm2):
    from jlora.model.loading import LoadedModel

    tiny = load_model("cpu-tiny")  # 512-row embedding; SmolLM2's tokenizer has 49152 tokens
    with pytest.raises(WeightsError, match="the tokenizer has 49152 tokens but the model's "
                                           "vocab_size is 512"):  # fmt: skip
        LoadedModel(tiny.config, tiny.params, smollm2.tokenizer, "test")


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_block_dequantization_agrees_with_the_gguf_package(type_name):
    """Our whole-tensor dequantization against the gguf package's, on random weights
    quantized by it (so every nibble, sign and scale occurs)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    weights = np.random.default_rng(0).standard_normal((48, 256)).astype(np.float32)
    data = gguf.quants.quantize(weights, qtype)
    expected = gguf.quants.dequantize(data, qtype).reshape(-1)
    np.testing.assert_array_equal(dequantize(data, type_name), expected)
    assert dequantize(data, "Q5_K") is None  # left to the gguf package
