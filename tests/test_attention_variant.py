"""A research variant of attention is one file (`nn.layers.self_attention`): a subclass of
`nn.attention.MultiHeadAttention` in the researcher's own module, named by model.attention.kind="module:Class".

Here the variant lives in a file written to a temporary folder (nothing in jaxformer is edited): its heads' context
doubled (`context` overridden). On the same seed it has the softmax model's parameters, so its logits equal the
softmax model's with every output projection wo doubled (an encoder-decoder's encoder too); cached decoding equals
its uncached call; its own `check` runs when the model is built; the export refuses it. Wrong implementations
caught: the path ignored (the softmax module built, for the encoder alone too), the class imported but its override
not reached from the block, the check never called; a bad path, a missing class or a class that is not an attention
module a traceback, not a named error.
"""
from __future__ import annotations

import sys
import textwrap

import jax
import numpy as np
import pytest
from flax import nnx

from jaxformer.config import ConfigError, ModelConfig, replaced
from jaxformer.nn import build_model
from helpers import cached_and_full

V = 17
VARIANT = textwrap.dedent('''
    import dataclasses

    from jaxformer.errors import ConfigError
    from jaxformer.nn.attention import MultiHeadAttention

    class Doubled(MultiHeadAttention):
        """Every head's context times its factor (two unless model.attention.options says)."""

        @dataclasses.dataclass(frozen=True)
        class Options:
            factor: float = 2.0
            note: str = ""
            exact: bool = False
            repeats: int = 1

        @classmethod
        def check(cls, cfg):
            if cfg.num_heads == 3:
                raise ConfigError(f"model.attention.kind={cfg.attention.kind!r} refuses model.num_heads=3")

        def context(self, q, *args, **kw):
            return self.options(self.cfg).factor * super().context(q, *args, **kw)

    NOT_A_CLASS = 3
''')


@pytest.fixture(scope="module")
def variant(tmp_path_factory):
    folder = tmp_path_factory.mktemp("variant")
    (folder / "my_attention.py").write_text(VARIANT)
    sys.path.insert(0, str(folder))
    yield "my_attention:Doubled"
    sys.path.remove(str(folder))
    sys.modules.pop("my_attention", None)


def _cfg(**kw) -> ModelConfig:
    base = dict(arch="decoder_only", num_encoder_layers=0, vocab_size=V, d_model=32, num_heads=4, num_kv_heads=2,
                d_ff=32, num_decoder_layers=2, max_len=16, positional="rope", norm__position="pre",
                runtime__dropout=0.0)
    return replaced(ModelConfig(), **{**base, **kw})


def test_a_variant_in_your_own_file_is_the_module_it_names(variant):
    model, plain = build_model(_cfg(attention__kind=variant), seed=3), build_model(_cfg(), seed=3)
    assert type(model.decoder.layers.blocks.self_attn).__name__ == "Doubled"
    wo = plain.decoder.layers.blocks.self_attn.wo
    wo[...] = 2 * wo[...]
    tokens = jax.random.randint(jax.random.key(1), (2, 6), 1, V)
    np.testing.assert_allclose(np.asarray(model(tokens)[0]), np.asarray(plain(tokens)[0]), rtol=1e-5, atol=1e-5)
    got, want, _ = cached_and_full(model, tokens, 3)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)


def test_an_encoder_decoder_s_encoder_uses_the_variant_too(variant):
    """model.attention.kind names the self-attention of both stacks: the encoder's memory equals the softmax
    model's with its encoder's wo doubled (and not the softmax model's own), and the logits equal it with every
    self-attention's wo doubled (the cross-attention stays softmax). Wrong implementation caught: EncoderBlock
    building MultiHeadAttention (softmax) while the decoder builds the variant."""
    kw = dict(arch="encoder_decoder", num_encoder_layers=2, attention__kind=variant)
    model, plain = build_model(_cfg(**kw), seed=3), build_model(_cfg(**{**kw, "attention__kind": "softmax"}), seed=3)
    src = jax.random.randint(jax.random.key(1), (2, 7), 1, V)
    tgt = jax.random.randint(jax.random.key(2), (2, 5), 1, V)
    softmax_memory = np.asarray(plain.encode(src).x)
    for stack in (plain.encoder, plain.decoder):
        wo = stack.layers.blocks.self_attn.wo
        wo[...] = 2 * wo[...]
    memory = np.asarray(model.encode(src).x)
    np.testing.assert_allclose(memory, np.asarray(plain.encode(src).x), rtol=1e-5, atol=1e-5)
    assert np.abs(memory - softmax_memory).max() > 1e-2                # doubling the context shows in the memory
    np.testing.assert_allclose(np.asarray(model(src, tgt)[0]), np.asarray(plain(src, tgt)[0]), rtol=1e-5, atol=1e-5)


def test_a_variants_options_are_its_own_config_section(variant):
    """model.attention.options ("name=value", set like any field) reach the variant typed as its Options
    declares; an option it does not declare, a value of the wrong type, a malformed or repeated entry, and any
    option for softmax attention (none declared) are ConfigErrors naming the field, when the model is built."""
    from jaxformer.configio import apply_overrides
    from jaxformer.nn.layers import self_attention
    from helpers import tiny_lm
    cfg = apply_overrides(tiny_lm(), [f"model.attention.kind={variant}",
                                      "model.attention.options=factor=3,note=a b,exact=true,repeats=4"]).model
    opts = self_attention(cfg).options(cfg)
    assert (opts.factor, opts.note, opts.exact, opts.repeats) == (3.0, "a b", True, 4)
    assert self_attention(replaced(cfg, attention__options=())).options(cfg).factor == 3.0
    model = build_model(_cfg(attention__kind=variant, attention__options=("factor=3",)), seed=3)
    plain = build_model(_cfg(), seed=3)
    wo = plain.decoder.layers.blocks.self_attn.wo
    wo[...] = 3 * wo[...]
    tokens = jax.random.randint(jax.random.key(1), (2, 6), 1, V)
    np.testing.assert_allclose(np.asarray(model(tokens)[0]), np.asarray(plain(tokens)[0]), rtol=1e-5, atol=1e-5)
    for options, message in ((("speed=3",), r"\['speed'\] not options of model.attention.kind='my_attention:Doubled'"
                                             r" \(its options: \['exact', 'factor', 'note', 'repeats'\]\)"),
                             (("factor=fast",), r"model.attention.options factor='fast' is not a float"),
                             (("exact=yes",), r"model.attention.options exact='yes' is not a bool"),
                             (("repeats=2.5",), r"model.attention.options repeats='2.5' is not an int")):
        with pytest.raises(ConfigError, match=message):
            build_model(_cfg(attention__kind=variant, attention__options=options))
    with pytest.raises(ConfigError, match=r"\['factor'\] not options of model.attention.kind='softmax' \(its "
                                          r"options: none\)"):
        build_model(_cfg(attention__options=("factor=3",)))
    for options, message in ((("factor",), "'factor' is not name=value"), (("=3",), "'=3' is not name=value"),
                             (("factor=1", "factor=2"), "names an option twice")):
        with pytest.raises(ConfigError, match=message):
            _cfg(attention__kind=variant, attention__options=options)


def test_the_variants_own_check_runs_when_built(variant):
    with pytest.raises(ConfigError, match=r"my_attention:Doubled'? refuses model.num_heads=3"):
        build_model(_cfg(attention__kind=variant, num_heads=3, num_kv_heads=1, d_model=24))


def test_the_export_refuses_a_variant(variant, tmp_path):
    from jaxformer.hf import HFError, save_pretrained
    model = build_model(_cfg(attention__kind=variant, norm__type="rmsnorm", activation="swiglu", use_bias=False,
                             scale_embeddings=False))
    with pytest.raises(HFError, match=r"model.attention.kind='my_attention:Doubled'"):
        save_pretrained(nnx.clone(model), tmp_path / "out", family="llama")


@pytest.mark.parametrize("kind, message", [
    ("flash", r"model.attention.kind='flash' is neither one of \('softmax', 'differential'\)"),
    ("my_attention.Doubled", "nor a 'package.module:Class' path"),
    ("no_such_module_here:X", "model.attention.kind='no_such_module_here:X' cannot be imported: ModuleNotFound"),
    ("my_attention:Missing", "model.attention.kind='my_attention:Missing' cannot be imported: AttributeError"),
    ("my_attention:NOT_A_CLASS", "is 3, not a subclass of jaxformer.nn.attention.MultiHeadAttention"),
    ("jaxformer.nn.layers:FeedForward", "not a subclass of jaxformer.nn.attention.MultiHeadAttention")])
def test_bad_kinds_are_named(variant, kind, message):
    with pytest.raises(ConfigError, match=message):
        build_model(_cfg(attention__kind=kind))
