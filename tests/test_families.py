"""Llama 3.x, Mistral and Qwen2 checkpoints against transformers and PEFT (issue 57).

Each family is a tiny random model written by transformers' own `save_pretrained`
(weights drawn with std 0.2, as in test_loaders.py, so a wrong RoPE frequency or a
missing bias moves the logits far past the tolerance), loaded by jlora from its Hugging
Face directory. jlora's last-position logits and greedy tokens must equal transformers',
including prompts longer than Llama 3's `original_max_position_embeddings` (16 here, so
the scaling acts), and biases that are not zero. A PEFT adapter on every projection of
each family (GQA shapes) must give PEFT's logits, on every backend.
"""

from __future__ import annotations

import json
import math

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from configs.engine import LORA_BACKENDS
from jlora.engine.api import SamplingParams
from jlora.model.loading import load_model
from jlora.model.weights import INDEX_FILE, SafetensorsFile, WeightsError
from tests.engine_helpers import make_engine, run_to_completion
from tests.model_helpers import TINY_HF, hf_last_logits, jlora_last_logits
from tests.tolerances import assert_close

pytestmark = pytest.mark.slow

LLAMA3_ROPE = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=16,
)
# name -> (transformers config class, model class, config arguments)
FAMILIES = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM",
               dict(rope_parameters={"rope_theta": 5e5, **LLAMA3_ROPE})),
    "llama3-meta-layout": ("LlamaConfig", "LlamaForCausalLM",
                           dict(rope_theta=5e5, rope_scaling=LLAMA3_ROPE)),
    "llama-linear": ("LlamaConfig", "LlamaForCausalLM",
                     dict(rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "llama-biases": ("LlamaConfig", "LlamaForCausalLM",
                     dict(attention_bias=True, mlp_bias=True, head_dim=24)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
}  # fmt: skip
# 1 token, within one KV block, past original_max_position_embeddings (16), past two blocks.
LENGTHS = (1, 7, 17, 60)


def _hf_model(family: str):
    """The family's tiny random model, its biases drawn non-zero."""
    import torch
    import transformers

    config_class, model_class, options = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**TINY_HF, **options)
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.5)
    return model


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(name, transformers model, jlora's load of its saved directory)."""
    path = tmp_path_factory.mktemp(request.param)
    model = _hf_model(request.param)
    model.save_pretrained(path)
    if request.param == "llama3-meta-layout":  # transformers 5 writes rope_parameters
        config = json.loads((path / "config.json").read_text())
        rope = config.pop("rope_parameters")
        config["rope_theta"] = rope.pop("rope_theta")
        config["rope_scaling"] = rope
        (path / "config.json").write_text(json.dumps(config))
    return request.param, model, load_model(str(path))


def test_logits_equal_transformers(family):
    name, hf, loaded = family
    rng = np.random.default_rng(0)
    for length in LENGTHS:
        ids = rng.integers(0, TINY_HF["vocab_size"], length).tolist()
        assert_close(
            jlora_last_logits(loaded, ids, bucket=64),
            hf_last_logits(hf, ids),
            jnp.float32,
            np.float32,
            scope="model",
        )
    config = loaded.config
    if name.startswith("llama3"):
        assert config.rope_scaling is not None and config.rope_scaling.type == "llama3"
    if name == "qwen2":
        assert config.qkv_bias and not config.o_bias and config.tie_embeddings
    if name == "llama-biases":
        assert config.o_bias and config.mlp_bias and config.head_dim == 24


def test_greedy_tokens_equal_transformers(family):
    """A batch of prompts of different lengths through the serving engine (paged KV,
    batched decode), 24 new tokens each, against transformers' greedy `generate`."""
    import torch

    _, hf, loaded = family
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, TINY_HF["vocab_size"], n).tolist() for n in (5, 20, 33)]
    engine = make_engine(loaded, max_slots=4, max_seq_len=128, min_bucket=16)
    ours = run_to_completion(engine, prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    engine.close()
    for prompt, result in zip(prompts, ours, strict=True):
        with torch.no_grad():
            theirs = hf.generate(
                torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                pad_token_id=0,
            )[0, len(prompt):].tolist()  # fmt: skip
        assert result["token_ids"] == theirs


@pytest.fixture(scope="module")
def adapted(family, tmp_path_factory):
    """A PEFT adapter on all seven projections of the family's model (rank 8, B random),
    and PEFT's model with it."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model

    name, hf, loaded = family
    path = tmp_path_factory.mktemp(f"{name}-adapter")
    peft_model = get_peft_model(
        copy.deepcopy(hf), LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")
    )
    torch.manual_seed(2)
    with torch.no_grad():
        for param_name, param in peft_model.named_parameters():
            if "lora_B" in param_name:
                param.normal_(0.0, 0.3)
    peft_model.save_pretrained(path)
    return path, peft_model.eval()


@pytest.mark.parametrize("backend", LORA_BACKENDS)
def test_a_peft_adapter_gives_pefts_logits(family, adapted, backend):
    _, _, loaded = family
    path, peft_model = adapted
    engine = make_engine(
        loaded, max_slots=1, max_seq_len=64, max_loras=1, max_lora_rank=8,
        lora_mode="cached", lora_backend=backend,
    )  # fmt: skip
    engine.register_adapter("a", str(path))
    engine.adapters.wait_pinned()
    rng = np.random.default_rng(3)
    for length in (7, 20):
        ids = rng.integers(0, TINY_HF["vocab_size"], length).tolist()
        ours = jlora_last_logits(loaded, ids, bucket=32, engine=engine, adapter="a")
        assert_close(ours, hf_last_logits(peft_model, ids), jnp.float32, np.float32, scope="model")
    engine.close()


# name -> LoraConfig arguments: rsLoRA on the GQA-shaped q/k/v, and every projection.
MIXED_ADAPTERS = {
    "qkv-r4-rslora": dict(r=4, lora_alpha=8, use_rslora=True,
                          target_modules=["q_proj", "k_proj", "v_proj"]),
    "all-r8": dict(r=8, lora_alpha=16, target_modules="all-linear"),
}  # fmt: skip
MIXED_ROWS = ["qkv-r4-rslora", None, "all-r8", "all-r8", None, "qkv-r4-rslora"]
MIXED_LENGTHS = (5, 20, 9, 33, 12, 17)
# backend, lora_mode: every backend, and the modes that load an adapter on demand, keep
# it cached, or prefill its rows on CPU workers while it is in flight.
MIXED_SERVING = [("reference", "ondemand"), ("reference", "cpu-assist"),
                 ("bgmv", "cached"), ("mbgmv", "ondemand")]  # fmt: skip
MIXED_TOKENS = 8


@pytest.fixture(scope="module")
def mixed(family, tmp_path_factory):
    """Both adapters saved by PEFT (A and B drawn at random), PEFT's model holding both,
    and the prompts."""
    import copy

    import torch
    from peft import LoraConfig, PeftModel, get_peft_model

    name, hf, _ = family
    root = tmp_path_factory.mktemp(f"{name}-mixed")
    for seed, (adapter, options) in enumerate(MIXED_ADAPTERS.items()):
        model = get_peft_model(copy.deepcopy(hf), LoraConfig(**options))
        torch.manual_seed(10 + seed)
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if "lora_" in param_name:  # A [r, in], B [out, r]: unit-scale products
                    param.normal_(0.0, 1.0 / param.shape[1] ** 0.5)
        model.save_pretrained(root / adapter)
    names = list(MIXED_ADAPTERS)
    peft = PeftModel.from_pretrained(copy.deepcopy(hf), root / names[0], adapter_name=names[0])
    for adapter in names[1:]:
        peft.load_adapter(root / adapter, adapter_name=adapter)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, TINY_HF["vocab_size"], n).tolist() for n in MIXED_LENGTHS]
    return root, peft.eval(), prompts


@pytest.fixture(scope="module")
def pefts_mixed_tokens(family, mixed):
    """PEFT's greedy tokens, each row with its adapter (or none), one row at a time; each
    adapter must change its rows' tokens."""
    import torch

    _, peft, prompts = mixed

    def generate(prompt: list[int], adapter: str) -> list[int]:
        with torch.no_grad():
            out = peft.generate(
                input_ids=torch.tensor([prompt]), adapter_names=[adapter],
                max_new_tokens=MIXED_TOKENS, do_sample=False, eos_token_id=None,
                pad_token_id=0,
            )  # fmt: skip
        return out[0, len(prompt) :].tolist()

    tokens = [generate(p, a or "__base__") for p, a in zip(prompts, MIXED_ROWS, strict=True)]
    for prompt, adapter, row in zip(prompts, MIXED_ROWS, tokens, strict=True):
        assert adapter is None or row != generate(prompt, "__base__"), adapter
    return tokens


@pytest.mark.parametrize(("backend", "lora_mode"), MIXED_SERVING)
def test_adapters_batch_with_base_rows_and_each_other(
    family, mixed, pefts_mixed_tokens, backend, lora_mode
):
    """Two adapters of different ranks and targets (one rsLoRA) and base rows in one
    batch of four decode slots: each row's greedy tokens are PEFT's for its adapter."""
    _, _, loaded = family
    root, _, prompts = mixed
    assisted = dict(emulated_link_gbps=0.001, cpu_workers=1) if lora_mode == "cpu-assist" else {}
    engine = make_engine(
        loaded, max_slots=4, max_seq_len=128, min_bucket=16, max_loras=2, max_lora_rank=8,
        lora_backend=backend, lora_mode=lora_mode, **assisted,
    )  # fmt: skip
    for adapter in MIXED_ADAPTERS:
        engine.register_adapter(adapter, str(root / adapter))
    ours = run_to_completion(
        engine, prompts, SamplingParams(max_tokens=MIXED_TOKENS, ignore_eos=True), MIXED_ROWS
    )
    if lora_mode == "cpu-assist":
        assert engine.counters["assisted_prefills"] >= 1
    engine.close()
    assert [r["token_ids"] for r in ours] == pefts_mixed_tokens


# -- a sharded bf16 checkpoint ------------------------------------------------------------


def test_a_sharded_bf16_checkpoint_loads_in_bf16_as_stored(tmp_path):
    """`save_pretrained` in bf16, in shards of at most 100 kB with their index: jlora
    serves it in bf16, every weight the very bf16 value stored, and bf16 logits close to
    transformers' bf16 model."""
    import torch

    model = _hf_model("llama3").to(torch.bfloat16)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) >= 2 and (tmp_path / INDEX_FILE).is_file()
    loaded = load_model(str(tmp_path), jnp.bfloat16)
    q = np.asarray(loaded.params["layers"]["q_proj"]["kernel"])
    assert q.dtype == jnp.bfloat16
    stored = model.model.layers[1].self_attn.q_proj.weight.detach().float().numpy()
    np.testing.assert_array_equal(q[1].astype(np.float32), stored.T)
    ids = list(range(3, 40))
    assert_close(
        jlora_last_logits(loaded, ids),
        hf_last_logits(model, ids),
        jnp.bfloat16,
        np.float32,
        scope="model",
    )


def test_loading_a_directory_shows_its_progress_on_stderr(tmp_path, capsys):
    """The bar the CLI's commands show while reading a checkpoint's tensors: all of them."""
    from jlora.cli.common import load_model_reporting

    _hf_model("qwen2").save_pretrained(tmp_path, max_shard_size="100KB")
    loaded = load_model_reporting(str(tmp_path), "float32")
    tensors = (
        2 + 12 * loaded.config.num_layers
    )  # embed, norm; per layer 7 kernels, 3 biases, 2 norms
    err = capsys.readouterr().err
    assert f"loading {tmp_path}" in err and f"{tensors}/{tensors}" in err


def test_a_quantized_tensor_is_refused_naming_it(tmp_path):
    """An I8 tensor (a quantization's, whose scale lives elsewhere) is never read as
    numbers; neither is an F8 one."""
    from safetensors.numpy import save_file

    save_file(
        {"w8": np.ones((2, 2), np.int8), "f8": np.ones((2,), ml_dtypes.float8_e4m3fn)},
        str(tmp_path / "q.safetensors"),
    )
    reader = SafetensorsFile(tmp_path / "q.safetensors")
    for name, dtype in (("w8", "I8"), ("f8", "F8_E4M3")):
        with pytest.raises(WeightsError, match=f"tensor {name} has dtype {dtype}"):
            reader.read(name)


def test_the_llama3_frequencies_are_transformers_own():
    """jlora's inverse frequencies against transformers' `_compute_llama3_parameters`,
    at Llama 3.1-8B's settings, to a float32 ulp (numpy's and torch's pow differ there)."""
    import torch
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from configs import load_preset
    from jlora.model.layers import inverse_frequencies

    preset = load_preset("llama3-8b").config
    scaling = preset.rope_scaling
    assert scaling is not None
    original = scaling.original_max_position_embeddings
    hf = LlamaConfig(
        hidden_size=4096, num_attention_heads=32, head_dim=128,
        max_position_embeddings=preset.max_context,
        rope_parameters={"rope_type": "llama3", "rope_theta": preset.rope_theta,
                         "factor": scaling.factor, "low_freq_factor": scaling.low_freq_factor,
                         "high_freq_factor": scaling.high_freq_factor,
                         "original_max_position_embeddings": original},
    )  # fmt: skip
    theirs, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](hf, torch.device("cpu"))
    assert attention_factor == 1.0 and not math.isnan(float(theirs.sum()))
    np.testing.assert_allclose(inverse_frequencies(preset), theirs.numpy(), rtol=2e-7, atol=0)


# -- tokenizer, template and generation defaults of a model directory -----------------------

# A template with what Hugging Face gives templates: loopcontrols, tojson with indent,
# raise_exception and strftime_now.
TEMPLATE = """{{- bos_token }}{{- "Year " + strftime_now("%Y") + "\\n" }}
{%- for message in messages %}
{%- if message.role not in ("system", "user", "assistant") %}
{{- raise_exception("unknown role " + message.role) }}
{%- endif %}
{%- if message.role == "system" and message.content == "skip" %}{% continue %}{% endif %}
{{- "<|" + message.role + "|>" + message.content + "<|eot_id|>" }}
{%- if loop.index >= 4 %}{% break %}{% endif %}
{%- endfor %}
{%- if tools %}{{- tools | tojson(indent=2) }}{% endif %}
{%- if add_generation_prompt %}{{- "<|assistant|>" }}{% endif %}"""
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]


def _model_dir(path, *, template_in: str):
    """A directory with a tiny byte-level BPE tokenizer whose post-processor adds the BOS,
    Llama 3's special tokens, the template in a file of its own or in a list, and a
    generation_config that samples and stops on <|eot_id|> too."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False)
    backend.train_from_iterator(["the quick brown fox jumps over the lazy dog é"] * 50, trainer)
    backend.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)]
    )
    backend.save(str(path / "tokenizer.json"))
    config = {"bos_token": SPECIALS[0], "eos_token": SPECIALS[1],
              "tokenizer_class": "PreTrainedTokenizerFast"}  # fmt: skip
    if template_in == "file":
        (path / "chat_template.jinja").write_text(TEMPLATE)
    else:
        config["chat_template"] = [{"name": "tool_use", "template": "x"},
                                   {"name": "default", "template": TEMPLATE}]  # fmt: skip
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    generation = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "eos_token_id": [1, 2]}
    (path / "generation_config.json").write_text(json.dumps(generation))
    return path


@pytest.mark.parametrize("template_in", ["file", "list"])
def test_a_directorys_tokenizer_template_and_stops_are_transformers_own(tmp_path, template_in):
    from transformers import AutoTokenizer

    from jlora.model.loading import generation_defaults
    from jlora.tokenizer import Tokenizer, TokenizerError

    path = _model_dir(tmp_path, template_in=template_in)
    ours, theirs = Tokenizer.from_dir(path), AutoTokenizer.from_pretrained(str(path))
    for text in ("the lazy dog", "fox é"):
        assert ours.encode(text) == theirs(text).input_ids  # the post-processor's BOS first
    assert ours.eos_ids == [1, 2]  # tokenizer_config's, then generation_config's
    messages = [
        {"role": "system", "content": "skip"},
        *({"role": "user", "content": f"q{i}"} for i in range(6)),
    ]
    if template_in == "list":
        theirs.chat_template = TEMPLATE  # transformers keeps the list's default as its own
    tools = [{"type": "function", "function": {"name": "f", "description": "é"}}]
    expected = theirs.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    assert ours.apply_chat_template(messages, tools=tools) == expected
    with pytest.raises(TokenizerError, match="unknown role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])
    assert generation_defaults(path) == {"temperature": 0.6, "top_p": 0.9}


# -- what is refused, naming it ---------------------------------------------------------------


def _tiny_gguf(path, arch: str = "llama", *, pre: str = "gpt2", rope_freqs: bool = False):
    """A GGUF file with the metadata of a tiny model and one tensor (enough to be refused)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in (("block_count", 1), ("embedding_length", 8), ("feed_forward_length", 16),
                       ("attention.head_count", 2), ("context_length", 64)):  # fmt: skip
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(["a", "b"])
    writer.add_token_merges([])
    writer.add_tensor("token_embd.weight", np.ones((2, 8), np.float32))
    if rope_freqs:
        writer.add_tensor("rope_freqs.weight", np.ones((2,), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    "options, names",
    [
        ({"arch": "qwen2"}, "general.architecture='qwen2' is not supported in a GGUF file"),
        ({"rope_freqs": True}, "tensor rope_freqs.weight"),
        ({"pre": "llama-bpe"}, "tokenizer.ggml.pre='llama-bpe' is not supported"),
    ],
    ids=["qwen2-arch", "rope-freqs", "llama-bpe"],
)
def test_a_gguf_jlora_cannot_serve_exits_2_naming_it(tmp_path, capsys, options, names):
    from jlora.cli.main import main

    path = _tiny_gguf(tmp_path / "m.gguf", **options)
    assert main(["generate", "--model", str(path), "--prompt", "ab"]) == 2
    assert names in capsys.readouterr().err


@pytest.mark.parametrize(
    "edit, names",
    [
        ({"quantization_config": {"quant_method": "awq", "bits": 4}},
         "quantization_config (quant_method='awq')"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
         "rope_type='yarn'"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"model_type": "gemma", "architectures": ["GemmaForCausalLM"]}, "model_type='gemma'"),
        ({"model_type": "mistral", "sliding_window": 64}, "sliding_window=64 is below"),
    ],
    ids=["quantized", "yarn", "gelu", "gemma", "small-window"],
)  # fmt: skip
def test_a_checkpoint_jlora_cannot_serve_exits_2_naming_the_field(tmp_path, capsys, edit, names):
    from jlora.cli.main import main

    _hf_model("llama3").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **edit}))
    command = ["serve", "--model", str(tmp_path), "--max-seq-len", "128", "--port", "0"]
    assert main(command) == 2
    assert names in capsys.readouterr().err
