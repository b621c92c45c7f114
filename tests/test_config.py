"""ModelConfig validation and dotted overrides: every error is a ConfigError naming the field and the value."""
from __future__ import annotations

import dataclasses
import re

import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.config import Config, ConfigError, DataConfig, ModelConfig, replaced
from jaxformer.configio import apply_overrides, override
from jaxformer.nn import build_model

TINY = dict(vocab_size=11, d_model=16, num_heads=4, d_ff=32, num_encoder_layers=1, num_decoder_layers=1,
            max_len=8, runtime__dropout=0.0)


def tiny(**kw) -> ModelConfig:
    return replaced(ModelConfig(), **{**TINY, **kw})


def raises_naming(*needles):
    """pytest.raises(ConfigError) whose message contains every needle (literally)."""
    return pytest.raises(ConfigError, match="(?s)" + "".join(f"(?=.*{re.escape(str(n))})" for n in needles))


def test_defaults_and_tiny_configs_are_valid():
    cfg = ModelConfig()
    assert (cfg.d_model, cfg.num_heads, cfg.head_size, cfg.kv_heads) == (512, 8, 64, 8)
    assert tiny().head_size == 4 and tiny(num_kv_heads=2).kv_heads == 2
    assert issubclass(ConfigError, ValueError)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.d_model = 3


@pytest.mark.parametrize("d_model,num_heads", [(30, 4), (16, 3), (10, 4)])
def test_d_model_not_multiple_of_num_heads(d_model, num_heads):
    with raises_naming("model.d_model", d_model, "model.num_heads", num_heads):
        tiny(d_model=d_model, num_heads=num_heads)


def test_d_model_message_is_exact():
    with pytest.raises(ConfigError, match=re.escape("model.d_model=30 is not a multiple of model.num_heads=4")):
        tiny(d_model=30, num_heads=4)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 3), (8, 3), (4, 8), (4, 0), (4, -2)])
def test_num_heads_not_multiple_of_num_kv_heads(num_heads, num_kv_heads):
    with raises_naming("model.num_kv_heads", num_kv_heads, "model.num_heads", num_heads):
        tiny(d_model=32, num_heads=num_heads, num_kv_heads=num_kv_heads)


@pytest.mark.parametrize("field,value", [
    ("positional", "rotary"), ("positional", "Sinusoidal"), ("activation", "silu"), ("activation", "tanh"),
    ("norm__position", "middle"), ("norm__type", "batchnorm"), ("arch", "encoder_only"), ("runtime__dtype", "float64"),
])
def test_unknown_names_are_rejected(field, value):
    with raises_naming(f"model.{field.replace('__', '.')}", repr(value)):
        tiny(**{field: value})


@pytest.mark.parametrize("value", [-0.1, 1.0, 1.5])
def test_dropout_out_of_range(value):
    with raises_naming("model.runtime.dropout", value):
        tiny(runtime__dropout=value)


@pytest.mark.parametrize("value", [0.0, 0.5, 0.99])
def test_dropout_in_range_is_accepted(value):
    assert tiny(runtime__dropout=value).runtime.dropout == value


@pytest.mark.parametrize("pad_id", [11, 100, -2])
def test_pad_id_outside_vocab(pad_id):
    with raises_naming("model.pad_id", pad_id, 11):
        tiny(pad_id=pad_id)


def test_pad_id_minus_one_means_no_token_is_padding():
    assert tiny(pad_id=-1).pad_id == -1


@pytest.mark.parametrize("field,value", [("vocab_size", -1), ("d_model", -16), ("num_heads", 0), ("d_ff", 0),
                                         ("max_len", 0), ("d_model", 16.0), ("num_heads", True)])
def test_non_positive_or_non_integer_sizes(field, value):
    with raises_naming(f"model.{field}", repr(value)):
        tiny(**{field: value})


@pytest.mark.parametrize("kw,needles", [
    (dict(num_decoder_layers=0), ["model.num_decoder_layers"]),
    (dict(num_encoder_layers=0), ["model.num_encoder_layers", "encoder_decoder"]),
    (dict(num_encoder_layers=-1), ["model.num_encoder_layers", "-1"]),
    (dict(norm__eps=0.0), ["model.norm.eps", "0.0"]),
    (dict(rope__base=-1.0), ["model.rope.base", "-1.0"]),
    (dict(positional="rope", d_model=12, num_heads=4), ["model.positional", "rope", "3"]),
])
def test_other_invalid_fields(kw, needles):
    with raises_naming(*needles):
        tiny(**kw)


def test_decoder_only_may_have_no_encoder_layers():
    assert tiny(arch="decoder_only", num_encoder_layers=0).num_encoder_layers == 0


# ----------------------------------------------------------------------------- lengths beyond max_len

@pytest.mark.parametrize("kind", ["learned", "sinusoidal"])
def test_check_length_beyond_max_len(kind):
    cfg = tiny(positional=kind, max_len=8)
    cfg.check_length(8)                                   # at the limit: fine
    with raises_naming("model.max_len=8", "9"):
        cfg.check_length(9)
    with raises_naming("model.max_len=8", "100", "source"):
        cfg.check_length(100, what="source")


@pytest.mark.parametrize("kind", ["rope", "alibi", "none"])
def test_relative_positions_have_no_length_limit(kind):
    tiny(positional=kind, max_len=8).check_length(10_000)   # must not raise


def test_learned_lm_called_beyond_max_len_raises():
    cfg = tiny(arch="decoder_only", num_encoder_layers=0, positional="learned", max_len=6)
    model = build_model(cfg)
    ok, _ = model(jnp.ones((1, 6), jnp.int32))
    assert ok.shape == (1, 6, 11) and np.isfinite(np.asarray(ok)).all()
    with raises_naming("model.max_len=6", "7"):
        model(jnp.ones((1, 7), jnp.int32))


@pytest.mark.parametrize("kind", ["learned", "sinusoidal"])
def test_explicit_positions_beyond_the_table_raise_eagerly(kind):
    model = build_model(tiny(arch="decoder_only", num_encoder_layers=0, positional=kind, max_len=8))
    x = jnp.ones((1, 3), jnp.int32)
    assert np.isfinite(np.asarray(model(x, positions=jnp.asarray([[5, 6, 7]]))[0])).all()   # last row of the table
    with raises_naming("position 8", "model.max_len=8"):
        model(x, positions=jnp.asarray([[6, 7, 8]]))


def test_sinusoidal_encoder_decoder_called_beyond_max_len_raises():
    cfg = tiny(positional="sinusoidal", max_len=5)
    model = build_model(cfg)
    with raises_naming("model.max_len=5", "6"):
        model.encode(jnp.ones((1, 6), jnp.int32))           # source too long
    memory = model.encode(jnp.ones((1, 5), jnp.int32))
    with raises_naming("model.max_len=5", "8"):
        model(memory, jnp.ones((1, 8), jnp.int32))                 # target too long


# ----------------------------------------------------------------------------- overrides

def test_override_parses_and_validates():
    cfg = tiny()
    new = override(cfg, "d_model", "64")
    assert new.d_model == 64 and isinstance(new.d_model, int) and cfg.d_model == 16   # a copy; cfg frozen
    assert override(cfg, "runtime.dropout", "0.25").runtime.dropout == 0.25
    assert override(cfg, "tie_embeddings", "false").tie_embeddings is False
    assert override(cfg, "num_kv_heads", "2").num_kv_heads == 2
    assert override(cfg, "num_kv_heads", "none").num_kv_heads is None
    assert override(cfg, "positional", "rope").positional == "rope"
    new = apply_overrides(cfg, ["d_model=32", " num_heads = 8 "])
    assert (new.d_model, new.num_heads) == (32, 8)


@pytest.mark.parametrize("key,raw", [("d_model", "abc"), ("d_model", "1.5"), ("runtime.dropout", "lots"),
                                     ("tie_embeddings", "maybe"), ("num_kv_heads", "two")])
def test_override_wrong_type_names_the_key(key, raw):
    with raises_naming(key, repr(raw)):
        override(tiny(), key, raw)


@pytest.mark.parametrize("key", ["d_modle", "model", "d_model.x", "heads"])
def test_override_unknown_key_names_it(key):
    with raises_naming(repr(key)):
        override(tiny(), key, "4")


@pytest.mark.parametrize("key,raw,needles", [
    ("d_model", "30", ["model.d_model=30", "model.num_heads=4"]),
    ("runtime.dropout", "1.5", ["model.runtime.dropout", "1.5"]),
    ("positional", "rotary", ["model.positional", "rotary"]),
    ("pad_id", "11", ["model.pad_id=11"]),
])
def test_override_to_an_invalid_value_is_validated(key, raw, needles):
    with raises_naming(*needles):
        override(tiny(), key, raw)


def test_apply_overrides_needs_key_value():
    with raises_naming("d_model"):
        apply_overrides(tiny(), ["d_model"])


def test_dotted_overrides_on_the_full_config():
    cfg = Config()
    new = override(cfg, "model.d_model", "64")
    assert new.model.d_model == 64 and cfg.model.d_model == 512 and new.data == cfg.data
    new = apply_overrides(cfg, ["model.runtime.dropout=0.0", "model.num_kv_heads=2"])
    assert (new.model.runtime.dropout, new.model.kv_heads) == (0.0, 2)


@pytest.mark.parametrize("key,raw,needles", [
    ("model.d_model", "abc", ["model.d_model", "'abc'"]),               # wrong type: the full dotted key
    ("model.d_modle", "4", ["model.d_modle"]),                          # unknown leaf
    ("modle.d_model", "4", ["modle.d_model"]),                          # unknown section
    ("model", "4", ["'model'", "section"]),                             # a section is not a value
    ("model.d_model.x", "4", ["model.d_model.x"]),                      # a value is not a section
    ("model.d_model", "30", ["model.d_model=30", "model.num_heads=8"]), # validated after parsing
])
def test_dotted_override_errors_name_the_key(key, raw, needles):
    with raises_naming(*needles):
        override(Config(), key, raw)


def test_full_config_checks_data_lengths_against_model_max_len():
    model = ModelConfig(max_len=5, positional="learned")
    with raises_naming("model.max_len=5", "7"):
        Config(model=model, data=DataConfig(task="reverse", min_len=3, max_len=6))   # 6 + 1 tokens


@pytest.mark.parametrize("field", ["norm.eps", "rope.base"])
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_nan_and_inf_positive_floats_are_rejected(field, value):
    """NaN compares False with everything, so a plain `value <= 0` check would let it through."""
    with raises_naming(f"model.{field}", value):
        tiny(**{field.replace(".", "__"): float(value)})
    with raises_naming(f"model.{field}", value):
        override(Config(), f"model.{field}", value)


@pytest.mark.parametrize("make, message", [
    (lambda: tiny(runtime__dropout="0.1"), "model.runtime.dropout='0.1' must be of type float"),
    (lambda: tiny(num_decoder_layers=True), "model.num_decoder_layers=True must be of type int"),
    (lambda: tiny(d_model=16.0), "model.d_model=16.0 must be of type int"),
    (lambda: tiny(norm__final=1), "model.norm.final=1 must be of type bool | None"),
    (lambda: DataConfig(gutenberg="no"), "data.gutenberg='no' must be of type bool"),
    (lambda: DataConfig(num_chars=1e4), "data.num_chars=10000.0 must be of type int | None"),
])
def test_wrong_types_are_config_errors_naming_field_value_and_type(make, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        make()


def test_ints_are_accepted_where_floats_are_declared():
    assert tiny(rope__base=10000, norm__eps=1).rope.base == 10000


def test_config_file_that_is_a_directory_or_calls_sys_exit_is_a_config_error(tmp_path):
    from jaxformer.configio import load_config_file
    (tmp_path / "cfg.py").mkdir()
    with pytest.raises(ConfigError, match="is a directory"):
        load_config_file(tmp_path / "cfg.py")
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(0)\n")
    with pytest.raises(ConfigError, match=re.escape("called sys.exit(0)")):
        load_config_file(tmp_path / "exits.py")
    (tmp_path / "exits_late.py").write_text("import sys\ndef get_config():\n    sys.exit(0)\n")
    with pytest.raises(ConfigError, match="called sys.exit"):
        load_config_file(tmp_path / "exits_late.py")


# ------------------------------------------------------------------------------- moved keys (issue 45, V.4)

def test_moved_keys_are_read_under_their_old_names_with_one_warning(caplog, tmp_path):
    """The router-loss weights moved from model to optim (with the output z-loss: the objective's weights in one
    section). Old --set keys and old run directories' config.json still read, each with a one-line warning
    naming the new key; both names with different values, and a config file passing the old name to
    ModelConfig, are named errors. Wrong implementations: an old key silently ignored (the default used), read
    without a warning, or the two names' conflict resolved silently."""
    import json
    from jaxformer.config import to_dict
    from jaxformer.configio import from_dict, load_config_file
    with caplog.at_level("WARNING", logger="jaxformer"):
        cfg = apply_overrides(Config(), ["model.moe_balance_weight=0.5"])
    assert cfg.optim.moe_balance_weight == 0.5
    assert [r.getMessage() for r in caplog.records] == [
        "config key model.moe_balance_weight is now optim.moe_balance_weight: read as optim.moe_balance_weight "
        "(update the config)"]
    old = to_dict(Config())
    old["model"]["moe_z_weight"] = 0.25
    del old["optim"]["moe_z_weight"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="jaxformer"):
        assert from_dict(json.loads(json.dumps(old))).optim.moe_z_weight == 0.25
    assert len(caplog.records) == 1 and "optim.moe_z_weight" in caplog.records[0].getMessage()
    old["optim"]["moe_z_weight"] = 0.5
    with pytest.raises(ConfigError, match="model.moe_z_weight=0.25 and optim.moe_z_weight=0.5"):
        from_dict(old)
    f = tmp_path / "old.py"
    f.write_text("from jaxformer.config import Config, ModelConfig\n"
                 "def get_config():\n    return Config(model=ModelConfig(moe_balance_weight=0.1))\n")
    with pytest.raises(ConfigError, match="model.moe_balance_weight is now optim.moe_balance_weight"):
        load_config_file(f)
