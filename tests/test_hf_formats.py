"""The Hugging Face formats published checkpoints actually carry, against transformers itself (every model is
built here from a config with random weights; nothing is downloaded):

- older config keys: top-level `rope_theta` and an old-style `rope_scaling` (`type` or `rope_type`; linear and
  llama3) instead of transformers 5's `rope_parameters`; GPT-2's `activation_function` spellings ("gelu" is the
  exact GELU, "gelu_new" and "gelu_pytorch_tanh" the tanh one) and Gemma's `hidden_act` / `hidden_activation`;
- GPT-2 files whose tensor names lack the `transformer.` prefix (and hold the attention-mask buffers), or
  that hold the tied head's copy `lm_head.weight`;
- export of a model built here: its own norm_eps, rope_base, head_dim and tying are written, transformers
  computes its logits; bfloat16 tensors and the token ids are written as asked;
- a pretrained folder's tokenizer: BOS only where its post-processor adds one, EOS from config.json's
  eos_token_id (the first of a list) else from the vocabulary, no padding id.

Each test was seen to fail on a plausible one-line wrong implementation (tests/mutants.py lists them)."""
from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from helpers import edited_config, random_hf_model  # noqa: E402
from jaxformer.config import ModelConfig, flat_items, replaced  # noqa: E402
from jaxformer.hf import HFError, from_pretrained, save_pretrained, to_model_config  # noqa: E402
from jaxformer.nn import build_model  # noqa: E402

V = 97
TOL = 2e-5         # float32, relative to the largest logit (observed ~3e-7; the exact GELU for the tanh one,
                   # the nearest wrong function here, gives ~8e-5)
IDS = np.random.default_rng(7).integers(0, V, (2, 12))


hf_model = random_hf_model


def hf_logits(m, ids=IDS):
    with torch.no_grad():
        return m(torch.tensor(ids)).logits.numpy()


def hf_load(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()


def rel(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())


def read(path) -> dict:
    return json.loads((path / "config.json").read_text())


LLAMA = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A Llama saved by transformers 5 (its config has rope_parameters, default RoPE, theta 10000)."""
    m = hf_model(transformers.LlamaConfig(**LLAMA))
    d = tmp_path_factory.mktemp("llama")
    m.save_pretrained(d)
    assert "rope_parameters" in read(d) and "rope_scaling" not in read(d)
    return m, d


LLAMA3_OLD = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 16}
OLD_ROPE = {   # case -> (the older keys config.json holds, the ModelConfig fields they mean)
    "rope_theta": (dict(rope_theta=500.0), dict(rope__base=500.0, rope__scaling="none")),
    "rope_scaling_type_linear": (dict(rope_theta=500.0, rope_scaling={"type": "linear", "factor": 4.0}),
                                 dict(rope__base=500.0, rope__scaling="linear", rope__factor=4.0)),
    "rope_scaling_rope_type_llama3": (dict(rope_theta=500.0, rope_scaling=LLAMA3_OLD),
                                      dict(rope__base=500.0, rope__scaling="llama3", rope__factor=8.0,
                                           rope__original_max_len=16, rope__low_freq_factor=1.0,
                                           rope__high_freq_factor=4.0)),
}


@pytest.mark.parametrize("case", OLD_ROPE)
def test_older_rope_keys_import_with_transformers_logits(llama, tmp_path, case):
    """Most published Llama-family checkpoints say rope_theta and rope_scaling at the top level of config.json
    (transformers 5 reads them as rope_parameters): the import computes what transformers reads them as."""
    m, d = llama
    keys, fields = OLD_ROPE[case]
    src = edited_config(d, tmp_path / case, rope_parameters=None, **keys)
    theirs = hf_logits(hf_load(src))
    assert rel(theirs, hf_logits(m)) > 1e-3                          # the older keys do change the function
    cfg = to_model_config(read(src))
    assert {k: flat_items(cfg)[k.replace("__", ".")] for k in fields} == fields
    assert rel(from_pretrained(src)(jnp.asarray(IDS))[0], theirs) < TOL


YARN = {   # case -> rope_parameters (YaRN) of a Llama config; each a different path of transformers' computation
    "defaults": {"factor": 4.0, "original_max_position_embeddings": 16},
    "attention_factor": {"factor": 4.0, "original_max_position_embeddings": 16, "attention_factor": 1.3,
                         "beta_fast": 16, "beta_slow": 2},
    "mscale": {"factor": 8.0, "original_max_position_embeddings": 8, "mscale": 1.0, "mscale_all_dim": 0.5},
    "untruncated": {"factor": 2.0, "original_max_position_embeddings": 32, "truncate": False},
}


@pytest.mark.parametrize("case", YARN)
def test_yarn_rope_imports_and_exports_with_transformers_logits(llama, tmp_path, case):
    """YaRN (Qwen2.5/Qwen3's long-context recipe, DeepSeek's mscale): frequencies blended by a ramp between
    beta_fast and beta_slow, cos/sin scaled by the attention factor. Imported: transformers' logits; exported
    again: transformers reads our config as the same function."""
    m, d = llama
    src = edited_config(d, tmp_path / case, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                                              **YARN[case]})
    theirs = hf_logits(hf_load(src))
    assert rel(theirs, hf_logits(m)) > 1e-3                          # YaRN changes the function
    model = from_pretrained(src)
    assert model.cfg.rope.scaling == "yarn"
    assert rel(model(jnp.asarray(IDS))[0], theirs) < TOL
    save_pretrained(model, tmp_path / "out")
    assert rel(hf_logits(hf_load(tmp_path / "out")), theirs) < TOL


@pytest.mark.parametrize("length", [6, 24])
def test_dynamic_ntk_rope_imports_and_exports_with_transformers_logits(tmp_path, length):
    """Dynamic NTK: past max_position_embeddings (8 here) the base grows with the call's length; within it, plain
    RoPE. A fresh transformers model per call (it keeps the longest length it has seen)."""
    cfg = transformers.LlamaConfig(**dict(LLAMA, max_position_embeddings=8),
                                   rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0})
    m = hf_model(cfg)
    m.save_pretrained(tmp_path / "saved")
    ids = np.random.default_rng(3).integers(0, V, (2, length))
    theirs = hf_logits(hf_model(cfg), ids)                  # the same weights (seed), a fresh cache of lengths
    model = from_pretrained(tmp_path / "saved")
    assert model.cfg.rope.scaling == "dynamic" and model.cfg.rope.original_max_len == 8
    assert rel(model(jnp.asarray(ids))[0], theirs) < TOL
    plain = transformers.LlamaConfig(**dict(LLAMA, max_position_embeddings=8))
    assert (rel(hf_logits(hf_model(plain), ids), theirs) > 1e-4) == (length > 8)      # TOL is 2e-5
    save_pretrained(model, tmp_path / "out")
    assert rel(hf_logits(hf_load(tmp_path / "out"), ids), theirs) < TOL


GPT2 = dict(vocab_size=V, n_positions=64, n_embd=32, n_layer=2, n_head=4)


@pytest.mark.parametrize("spelling,activation", [("gelu", "gelu"), ("gelu_new", "gelu_tanh"),
                                                 ("gelu_pytorch_tanh", "gelu_tanh")])
def test_gpt2_activation_spellings_import_as_the_function_transformers_runs(tmp_path, spelling, activation):
    """GPT-2's activation_function: "gelu" is the exact (erf) GELU, "gelu_new" and "gelu_pytorch_tanh" its tanh
    approximation (transformers' ACT2FN)."""
    m = hf_model(transformers.GPT2Config(activation_function=spelling, **GPT2))
    m.save_pretrained(tmp_path)
    assert read(tmp_path)["activation_function"] == spelling
    assert to_model_config(read(tmp_path)).activation == activation
    assert rel(from_pretrained(tmp_path)(jnp.asarray(IDS))[0], hf_logits(m)) < TOL


GEMMA = dict(LLAMA, head_dim=16)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    m = hf_model(transformers.GemmaConfig(**GEMMA))
    d = tmp_path_factory.mktemp("gemma")
    m.save_pretrained(d)
    assert read(d)["hidden_act"] == "gelu_pytorch_tanh"
    return m, d


@pytest.mark.parametrize("keys", [dict(hidden_act="gelu_new"),
                                  dict(hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh")],
                         ids=["hidden_act_gelu_new", "hidden_activation_same"])
def test_gemma_activation_spellings_import_with_transformers_logits(gemma, tmp_path, keys):
    """Gemma's hidden_act "gelu_new" is the same tanh GELU as "gelu_pytorch_tanh"; a hidden_activation equal to
    hidden_act (Gemma 1.1's files carry both) says nothing more."""
    m, d = gemma
    src = edited_config(d, tmp_path / "g", **keys)
    theirs = hf_logits(hf_load(src))
    assert rel(theirs, hf_logits(m)) < TOL
    assert to_model_config(read(src)).activation == "geglu_tanh"
    assert rel(from_pretrained(src)(jnp.asarray(IDS))[0], theirs) < TOL


def test_a_gemma_hidden_activation_other_than_hidden_act_is_refused(gemma, tmp_path):
    """transformers 5 runs hidden_act, older versions ran hidden_activation: two different names say two
    different functions, and the import refuses rather than pick one."""
    src = edited_config(gemma[1], tmp_path / "g", hidden_activation="gelu")
    with pytest.raises(HFError, match="hidden_activation='gelu'"):
        from_pretrained(src)


def test_gemma_legacy_hidden_act_gelu_imports_as_transformers_runs_it(gemma, tmp_path):
    """google/gemma-2b's config.json says hidden_act "gelu"; transformers (GemmaConfig) runs the tanh GELU."""
    m, d = gemma
    src = edited_config(d, tmp_path / "g", hidden_act="gelu")
    theirs = hf_logits(hf_load(src))
    assert rel(theirs, hf_logits(m)) < TOL                             # transformers: the tanh GELU
    assert rel(from_pretrained(src)(jnp.asarray(IDS))[0], theirs) < TOL


@pytest.mark.parametrize("variant", ["no_prefix_with_mask_buffers", "tied_head_copy"])
def test_a_gpt2_file_as_published_imports(tmp_path, variant):
    """Many published GPT-2 files name their tensors `h.0.attn.c_attn.weight`, `wte.weight`, ... (no
    `transformer.`) and hold each layer's causal-mask buffers `h.i.attn.bias` / `h.i.attn.masked_bias`; others
    (a PyTorch state dict converted) hold the tied head's copy `lm_head.weight`. transformers reads each as the
    same model, and so does the import."""
    from safetensors.numpy import load_file, save_file
    m = hf_model(transformers.GPT2Config(**GPT2))
    m.save_pretrained(tmp_path / "saved")
    tensors = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert "transformer.h.1.attn.c_attn.weight" in tensors and "lm_head.weight" not in tensors
    if variant == "tied_head_copy":
        tensors["lm_head.weight"] = tensors["transformer.wte.weight"].copy()
    else:
        tensors = {k.removeprefix("transformer."): v for k, v in tensors.items()}
        causal = np.tril(np.ones((64, 64), bool))[None, None]
        for i in range(2):
            tensors.update({f"h.{i}.attn.bias": causal, f"h.{i}.attn.masked_bias": np.array(-1e4, np.float32)})
    src = tmp_path / variant
    src.mkdir()
    shutil.copy(tmp_path / "saved" / "config.json", src / "config.json")
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    theirs = hf_logits(hf_load(src))
    assert rel(theirs, hf_logits(m)) < TOL                      # transformers reads this file as the same model
    assert rel(from_pretrained(src)(jnp.asarray(IDS))[0], theirs) < TOL


BASE = replaced(ModelConfig(), arch="decoder_only", vocab_size=V, d_model=32, num_heads=4, num_kv_heads=2, d_ff=48,
                   num_encoder_layers=0, num_decoder_layers=2, max_len=64, runtime__dropout=0.0, norm__position="pre",
                   norm__type="rmsnorm", positional="rope", activation="swiglu", use_bias=False, tie_embeddings=False,
                   scale_embeddings=False, pad_id=-1)
GPT2_SHAPE = replaced(BASE, positional="learned", norm__type="layernorm", activation="gelu_tanh",
                                 use_bias=True, tie_embeddings=True, num_kv_heads=None)
BUILT = {   # a model built here -> (its config, the config.json entries it must write, the family's defaults)
    "llama_own_eps_theta_head_dim": (
        replaced(BASE, norm__eps=1e-3, rope__base=500.0, head_dim=16),
        dict(model_type="llama", rms_norm_eps=1e-3, head_dim=16, tie_word_embeddings=False),
        dict(norm__eps=1e-6, rope__base=10000.0)),
    "gpt2_own_eps_tied": (replaced(GPT2_SHAPE, norm__eps=1e-3),
                          dict(model_type="gpt2", layer_norm_epsilon=1e-3, tie_word_embeddings=True),
                          dict(norm__eps=1e-5)),
}


def random_model(cfg: ModelConfig, seed: int = 0):
    """Our model of `cfg` with every parameter (norm scales included) drawn around its init."""
    graph, state = nnx.split(build_model(cfg, seed=seed))
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    leaves = [x + 0.3 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    return nnx.merge(graph, jax.tree.unflatten(tree, leaves))


@pytest.mark.parametrize("shape", BUILT)
def test_export_of_a_model_built_here_writes_its_own_settings(tmp_path, shape):
    """A model trained here (not imported) exports its own norm_eps, rope_base, head_dim and tying, not the
    family's defaults: transformers computes its logits. The settings are far enough from the defaults that
    the defaults would give other logits."""
    cfg, entries, defaults = BUILT[shape]
    model = random_model(cfg)
    ours = np.asarray(model(jnp.asarray(IDS))[0])
    for field, default in defaults.items():               # the same weights with the default: other logits
        assert rel(random_model(replaced(cfg, **{field: default}))(jnp.asarray(IDS))[0], ours) > 1e-3
    written = save_pretrained(model, tmp_path / "out")
    assert read(tmp_path / "out") == written
    assert {k: written[k] for k in entries} == entries
    if cfg.positional == "rope":
        assert written["rope_parameters"]["rope_theta"] == cfg.rope.base
    theirs = hf_load(tmp_path / "out")
    assert rel(hf_logits(theirs), ours) < TOL


def test_a_bfloat16_export_writes_bfloat16_tensors_and_the_token_ids(tmp_path):
    """save_pretrained(dtype="bfloat16") writes bfloat16 tensors, which transformers runs as our model up to
    their rounding; token_ids (the run's tokenizer's, from export-hf) reach config.json."""
    from safetensors import safe_open
    model = random_model(BASE)
    save_pretrained(model, tmp_path / "out", dtype="bfloat16", token_ids={"bos_token_id": 5, "eos_token_id": 6})
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="numpy") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32,
                                                               attn_implementation="eager").eval()
    assert (theirs.config.bos_token_id, theirs.config.eos_token_id) == (5, 6)        # not Llama's defaults 1, 2
    assert read(tmp_path / "out")["torch_dtype"] == "bfloat16"
    graph, state = nnx.split(model)
    rounded = nnx.merge(graph, jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(x.dtype), state))
    assert rel(hf_logits(theirs), rounded(jnp.asarray(IDS))[0]) < TOL          # our model, its weights in bfloat16


def tokenizer_folder(path, config: dict, *, bos_template: bool):
    """A folder with config.json and a tokenizer.json of a 7-token vocabulary ('<s>' 1, '</s>' 2, '<|eot|>' 3,
    '<|endoftext|>' 4); bos_template: its post-processor starts every encoding with <s> (Llama's does)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<|eot|>": 3, "<|endoftext|>": 4, "a": 5, "b": 6}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(list(vocab)[:5])
    if bos_template:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    (path / "config.json").write_text(json.dumps(config))
    return path


TOKENIZERS = {   # case -> (config.json, post-processor adds <s>, expected (bos_id, eod_id, pad_id))
    "llama_like": ({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}, True, (1, 2, -1)),
    "gpt2_like": ({"bos_token_id": 4, "eos_token_id": 4}, False, (None, 4, -1)),
    "bos_named_not_added": ({"bos_token_id": 1, "eos_token_id": 2}, False, (None, 2, -1)),
    "eos_list_first": ({"bos_token_id": 1, "eos_token_id": [3, 2]}, True, (1, 3, -1)),
    "eos_config_over_vocab": ({"eos_token_id": 3}, False, (None, 3, -1)),
    "eos_from_vocab": ({}, False, (None, 2, -1)),
}


@pytest.mark.parametrize("case", TOKENIZERS)
def test_a_pretrained_folders_tokenizer_reads_its_special_ids(tmp_path, case):
    """BOS only when the tokenizer's own post-processor adds it (Llama's), not merely because config.json names
    one (GPT-2's names its <|endoftext|>); EOS is config.json's eos_token_id (the first of a list, as Llama 3's
    [<|end_of_text|>, <|eot_id|>, ...]), else </s> or <|endoftext|> from the vocabulary; no id is padding."""
    from jaxformer.data.tokenizers import pretrained_tokenizer
    config, bos_template, expected = TOKENIZERS[case]
    folder = tokenizer_folder(tmp_path / case, config, bos_template=bos_template)
    tok = pretrained_tokenizer(folder)
    assert (tok.bos_id, tok.eod_id, tok.pad_id) == expected
    from tokenizers import Tokenizer
    ref = Tokenizer.from_file(str(folder / "tokenizer.json"))           # what the tokenizer itself does
    assert (ref.encode("a b").ids[0] == 1) == (tok.bos_id is not None)
    assert tok.encode("a b").tolist() == [5, 6]


# The keys current published checkpoints carry beside the ones the import reads (their config.json verbatim but for
# sizes): every one of these was refused before issue 47, though none changes the function transformers computes.
PUBLISHED = {
    "HuggingFaceTB/SmolLM2-135M (llama)": (transformers.LlamaConfig, LLAMA, dict(
        is_llama_config=True, rope_interleaved=False, pretraining_tp=1, rope_scaling=None, head_dim=8,
        **{"transformers.js_config": {"kv_cache_dtype": {"q4f16": "float16", "fp16": "float16"}}})),
    "Qwen/Qwen2.5-0.5B (qwen2)": (transformers.Qwen2Config, LLAMA, dict(
        use_mrope=False, use_sliding_window=False, sliding_window=32768, max_window_layers=24, rope_theta=1e6,
        rope_scaling=None, attn_implementation="sdpa")),
    "Qwen/Qwen3-0.6B (qwen3)": (transformers.Qwen3Config, dict(LLAMA, head_dim=8), dict(
        layer_types=["full_attention"] * 2, max_window_layers=28, use_sliding_window=False, sliding_window=None,
        rope_scaling=None, attention_bias=False)),
    "openai-community/gpt2-medium (gpt2)": (transformers.GPT2Config, GPT2, dict(
        n_special=0, predict_special_tokens=True, n_ctx=64, summary_type="cls_index", summary_use_proj=True,
        summary_activation=None, summary_proj_to_labels=True, summary_first_dropout=0.1,
        task_specific_params={"text-generation": {"do_sample": True, "max_length": 50}})),
    "google/gemma-1.1-2b-it (gemma)": (transformers.GemmaConfig, GEMMA, dict(
        hidden_act="gelu", hidden_activation="gelu_pytorch_tanh", attn_implementation="eager")),
    "mistralai/Mistral-7B-v0.3 (mistral)": (transformers.MistralConfig, LLAMA, dict(
        sliding_window=None, rope_theta=1e6, tie_word_embeddings=False, attention_dropout=0.0, hidden_act="silu")),
    "google/gemma-2-2b (gemma2)": (transformers.Gemma2Config, dict(LLAMA, head_dim=16, num_hidden_layers=4,
                                                                   sliding_window=4, query_pre_attn_scalar=24,
                                                                   attn_logit_softcapping=5.0,
                                                                   final_logit_softcapping=3.0), dict(
        layer_types=None, cache_implementation="hybrid", hidden_act="gelu_pytorch_tanh",
        hidden_activation="gelu_pytorch_tanh", attention_bias=False, pad_token_id=0, eos_token_id=1, bos_token_id=2)),
}


@pytest.mark.parametrize("name", PUBLISHED)
def test_a_published_config_imports_with_transformers_logits(tmp_path, name):
    """Each family's current public config keys load, with transformers' logits (and a value that would change
    the function is still refused: use_mrope=true, below)."""
    cls, sizes, keys = PUBLISHED[name]
    m = hf_model(cls(**sizes))
    m.save_pretrained(tmp_path / "saved")
    src = edited_config(tmp_path / "saved", tmp_path / "published", **keys)
    theirs = hf_logits(hf_load(src))
    assert rel(theirs, hf_logits(m)) < TOL
    assert rel(from_pretrained(src)(jnp.asarray(IDS))[0], theirs) < TOL


GEMMA2 = dict(LLAMA, head_dim=16, num_hidden_layers=4, sliding_window=4, query_pre_attn_scalar=24,
              attn_logit_softcapping=5.0, final_logit_softcapping=3.0)


@pytest.mark.parametrize("case", ["alternating", "layer_types"])
def test_gemma2_imports_and_exports_with_transformers_logits(tmp_path, case):
    """Gemma 2: sandwich norms (four per layer, each (1 + w)), attention-logit and final-logit soft-capping,
    sliding windows on every other layer (or as layer_types says), the scale 1/sqrt(query_pre_attn_scalar); on
    12 tokens with a window of 4 and caps small enough to bend the logits. Exported again: transformers reads it
    as the same function."""
    extra = {} if case == "alternating" else dict(layer_types=["full_attention", "sliding_attention"] * 2)
    m = hf_model(transformers.Gemma2Config(**GEMMA2, **extra))
    m.save_pretrained(tmp_path / "saved")
    src = edited_config(tmp_path / "saved", tmp_path / "src", **({"layer_types": None} if not extra else {}))
    cfg = to_model_config(read(src))
    assert cfg.norm.position == "sandwich" and cfg.attention.softcap == 5.0 and cfg.logit_softcap == 3.0
    assert cfg.layer_windows() == ((4, 0, 4, 0) if not extra else (0, 4, 0, 4)) and cfg.attention.scale_dim == 24
    theirs = hf_logits(m)
    assert rel(from_pretrained(src)(jnp.asarray(IDS))[0], theirs) < TOL
    save_pretrained(from_pretrained(src), tmp_path / "out")
    assert read(tmp_path / "out")["model_type"] == "gemma2"
    assert rel(hf_logits(hf_load(tmp_path / "out")), theirs) < TOL


QWEN_WINDOWS = {   # case -> (config keys, the windows they mean per layer of 2)
    "max_window_layers": (dict(use_sliding_window=True, sliding_window=4, max_window_layers=1), (0, 4)),
    "layer_types": (dict(use_sliding_window=True, sliding_window=3,
                         layer_types=["sliding_attention", "full_attention"]), (3, 0)),
    "off": (dict(use_sliding_window=False, sliding_window=4, max_window_layers=0), ()),
}


@pytest.mark.parametrize("case", QWEN_WINDOWS)
def test_qwen_sliding_windows_import_with_transformers_logits(tmp_path, case):
    """Qwen2's sliding windows from layer max_window_layers on (or as layer_types says), on 12 tokens with
    windows of 3-4: transformers' logits."""
    keys, windows = QWEN_WINDOWS[case]
    m = hf_model(transformers.Qwen2Config(**LLAMA, **keys))
    m.save_pretrained(tmp_path / "saved")
    # transformers writes the layer_types it derived; published Qwen2.5 files carry only max_window_layers
    src = edited_config(tmp_path / "saved", tmp_path / "src", **({} if "layer_types" in keys else
                                                                 {"layer_types": None}))
    cfg = to_model_config(read(src))
    assert cfg.attention.windows == windows
    if windows:
        assert rel(hf_logits(m), hf_logits(hf_model(transformers.Qwen2Config(**LLAMA)))) > 1e-3
    assert rel(hf_logits(hf_load(src)), hf_logits(m)) < TOL
    assert rel(from_pretrained(src)(jnp.asarray(IDS))[0], hf_logits(m)) < TOL


def test_a_key_accepted_only_at_its_inert_value_is_refused_at_another(tmp_path):
    d = dict(model_type="qwen2", **LLAMA)
    assert to_model_config(d | {"use_mrope": False}).num_decoder_layers == 2
    with pytest.raises(HFError, match="use_mrope=True"):
        to_model_config(d | {"use_mrope": True})
    with pytest.raises(HFError, match="rope_interleaved2 \\(unknown key\\)"):
        to_model_config(d | {"rope_interleaved2": False})


def sentencepiece_folder(path, llama_config: dict | None = None):
    """A folder published as Llama 2's was: config.json and a SentencePiece tokenizer.model only (BPE with byte
    fallback, Llama's identity normaliser, dummy prefix; <unk> 0, <s> 1, </s> 2), trained here on the built-in
    corpus."""
    import io
    import sentencepiece as spm
    from jaxformer.data.text import corpus_path
    text = corpus_path("builtin:alice").read_text(encoding="utf-8")
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(text.splitlines()[:3000]), model_writer=buf,
                                   vocab_size=400, model_type="bpe", unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
                                   byte_fallback=True, character_coverage=1.0, normalization_rule_name="identity",
                                   remove_extra_whitespaces=False, add_dummy_prefix=True, minloglevel=2)
    path.mkdir()
    (path / "tokenizer.model").write_bytes(buf.getvalue())
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    (path / "config.json").write_text(json.dumps(llama_config or {"bos_token_id": 1, "eos_token_id": 2}))
    return path


def test_a_sentencepiece_only_folder_tokenizes_as_its_model(tmp_path):
    """Before: a folder without tokenizer.json was refused. Its ids are the model's own (no offset), no id is
    padding, EOS ends a document and BOS opens prompts, and text is tokenized as transformers' LlamaTokenizer
    tokenizes it, except that a leading space keeps SentencePiece's dummy prefix (the model's own rule, as Meta's
    reference code encodes; transformers 5 drops that "▁")."""
    import sentencepiece
    from jaxformer.data.tokenizers import SentencePieceTokenizer, pretrained_tokenizer, tokenizer_from_json
    folder = sentencepiece_folder(tmp_path / "sp")
    tok = pretrained_tokenizer(folder)
    assert isinstance(tok, SentencePieceTokenizer)
    assert (tok.offset, tok.pad_id, tok.eod_id, tok.bos_id, tok.vocab_size) == (0, -1, 2, 1, 400)
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    texts = ["Alice was beginning to get very tired", "two  spaces\nand a line", "é字 12345", "end.", "tab\tx",
             "Ünïcödé ‘quotes’ — dash"]
    for t in texts:
        assert tok.encode(t).tolist() == theirs(t, add_special_tokens=False)["input_ids"], t
        assert tok.decode(tok.encode(t)) == t
    sp = sentencepiece.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    assert tok.encode(" lead").tolist() == sp.encode(" lead") != theirs(" lead", add_special_tokens=False)["input_ids"]
    back = tokenizer_from_json(json.loads(json.dumps(tok.to_json())))
    assert back.to_json() == tok.to_json() and back.encode("Alice").tolist() == tok.encode("Alice").tolist()
    (folder / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False}))
    assert pretrained_tokenizer(folder).bos_id is None


@pytest.mark.slow          # import-hf of a SentencePiece-only folder, generation, export (~20 s)
def test_a_sentencepiece_only_checkpoint_imports_generates_and_exports(tmp_path, capsys):
    from jaxformer.cli import main as cli
    from jaxformer.inference import generate_text, load_model
    folder = sentencepiece_folder(tmp_path / "sp")
    m = hf_model(transformers.LlamaConfig(vocab_size=400, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                          bos_token_id=1, eos_token_id=2))
    m.save_pretrained(folder)
    run = tmp_path / "run"
    assert cli(["import-hf", str(folder), "--workdir", str(run), "--set", "data.block_size=32"]) == 0
    loaded = load_model(run)
    assert loaded.tokenizer.bos_id == 1 and loaded.tokenizer.pad_id == -1
    assert rel(loaded.model(jnp.asarray(IDS % 400))[0], hf_logits(m, IDS % 400)) < TOL
    assert all(isinstance(t, str) for t in generate_text(loaded, ["Alice was"], max_new=4))
    assert cli(["export-hf", "--workdir", str(run), "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "tokenizer.model").read_bytes() == (folder / "tokenizer.model").read_bytes()
    capsys.readouterr()
