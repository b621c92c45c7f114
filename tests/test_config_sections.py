"""The model config in sections (issue 45, V.4): model.norm, .rope, .attention, .moe, .ablation and .runtime.

Wrong implementations each test would catch: an old flat key silently ignored (its default used) or read without
a warning; a section that does not validate itself (a bad value accepted until some later use); `replaced`
setting a field of the wrong section; `init_from`/restore comparing the runtime section (a bf16 or remat run
refused) or ignoring a section that changes the function (a different norm accepted); resuming with a changed
nested key unnoticed; the dotted --set path not reaching a section.
"""
from __future__ import annotations

import json
import re

import pytest

from jaxformer.config import (SECTIONED, AttentionConfig, Config, ConfigError, ModelConfig, NormConfig,
                              RuntimeConfig, flat_items, replaced, resume_differences, to_dict)
from jaxformer.configio import MOVED, apply_overrides, from_dict, load_config_file


def test_every_old_flat_key_has_a_new_home_and_reads_with_one_warning(caplog):
    """Each old flat model key (a run directory's config.json before the sections) lands on its new field."""
    for old in SECTIONED:
        assert not hasattr(ModelConfig(), old), old
    old_cfg = to_dict(Config())
    for old, new in SECTIONED.items():
        section, field = new.split(".")
        old_cfg["model"][old] = old_cfg["model"][section].pop(field)
    old_cfg["model"] = {k: v for k, v in old_cfg["model"].items() if not isinstance(v, dict) or v}
    old_cfg["model"]["norm_position"], old_cfg["model"]["dtype"] = "pre", "bfloat16"
    old_cfg["model"]["attention_windows"] = [4, 0]                     # JSON lists back to the declared tuple
    with caplog.at_level("WARNING", logger="jaxformer"):
        cfg = from_dict(json.loads(json.dumps(old_cfg)))
    assert (cfg.model.norm.position, cfg.model.runtime.dtype, cfg.model.attention.windows) == \
        ("pre", "bfloat16", (4, 0))
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == len(SECTIONED)
    assert "config key model.norm_position is now model.norm.position: read as model.norm.position " \
           "(update the config)" in warned


def test_old_and_new_spellings_that_disagree_are_a_named_error():
    d = to_dict(Config())
    d["model"]["remat"] = "full"                                          # the old name, next to runtime.remat
    with pytest.raises(ConfigError, match=re.escape("model.remat='full' and model.runtime.remat='none'")):
        from_dict(d)
    d["model"]["remat"] = "none"                                          # the same value twice: fine
    assert from_dict(d).model.runtime.remat == "none"


def test_set_takes_dotted_paths_and_old_keys_with_a_warning(caplog):
    cfg = apply_overrides(Config(), ["model.norm.position=pre", "model.runtime.remat=dots",
                                     "model.attention.windows=[4,0]", "model.moe.top_k=2"])
    assert (cfg.model.norm.position, cfg.model.runtime.remat, cfg.model.attention.windows, cfg.model.moe.top_k) \
        == ("pre", "dots", (4, 0), 2)
    with caplog.at_level("WARNING", logger="jaxformer"):
        old = apply_overrides(Config(), ["model.rope_base=500", "model.dropout=0"])
    assert (old.model.rope.base, old.model.runtime.dropout) == (500.0, 0.0)
    assert len(caplog.records) == 2 and "model.rope.base" in caplog.records[0].getMessage()
    with pytest.raises(ConfigError, match="model.norm.positon"):
        apply_overrides(Config(), ["model.norm.positon=pre"])
    with pytest.raises(ConfigError, match="'model.norm' is a section"):
        apply_overrides(Config(), ["model.norm=pre"])


def test_a_config_file_with_an_old_keyword_names_the_new_spelling(tmp_path):
    f = tmp_path / "old.py"
    f.write_text("from jaxformer.config import Config, ModelConfig\n"
                 "def get_config():\n    return Config(model=ModelConfig(norm_position='pre'))\n")
    with pytest.raises(ConfigError, match=re.escape("model.norm_position is now model.norm.position: "
                                                    "ModelConfig(norm=NormConfig(position=...))")):
        load_config_file(f)


@pytest.mark.parametrize("make,needle", [
    (lambda: NormConfig(position="middle"), "model.norm.position='middle'"),
    (lambda: NormConfig(eps=0.0), "model.norm.eps=0.0"),
    (lambda: AttentionConfig(windows=(-1,)), "model.attention.windows=(-1,)"),
    (lambda: AttentionConfig(scale="half"), "model.attention.scale='half'"),
    (lambda: RuntimeConfig(dropout=1.0), "model.runtime.dropout=1.0"),
    (lambda: RuntimeConfig(attention_backend="flash"), "model.runtime.attention_backend='flash'"),
])
def test_each_section_validates_itself_naming_the_dotted_key(make, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        make()


def test_cross_section_checks_stay_with_the_model():
    with pytest.raises(ConfigError, match=re.escape("model.attention.windows=(3, 0, 1): its pattern")):
        replaced(ModelConfig(), num_decoder_layers=2, attention__windows=(3, 0, 1))
    with pytest.raises(ConfigError, match="model.rope.scaling='linear' needs model.positional='rope'"):
        replaced(ModelConfig(), rope__scaling="linear", rope__factor=2.0)
    with pytest.raises(ConfigError, match="model.runtime.attention_backend='cudnn'"):
        replaced(ModelConfig(arch="decoder_only"), runtime__attention_backend="cudnn")


def test_replaced_reaches_into_sections_and_names_unknown_keys():
    m = replaced(ModelConfig(), d_model=64, norm__position="pre", runtime__dtype="bfloat16")
    assert (m.d_model, m.norm.position, m.norm.type, m.runtime.dtype, m.runtime.remat) == \
        (64, "pre", "layernorm", "bfloat16", "none")
    with pytest.raises(ConfigError, match="unknown config key 'norm.positon'"):
        replaced(ModelConfig(), norm__positon="pre")
    with pytest.raises(ConfigError, match="'d_model' is a value, not a section"):
        replaced(ModelConfig(), d_model__x=1)


def test_the_function_is_the_model_up_to_its_runtime():
    base = ModelConfig(arch="decoder_only")
    fast = replaced(base, runtime__dtype="bfloat16", runtime__remat="dots", runtime__dropout=0.0)
    assert fast != base and fast.function() == base.function()
    assert replaced(base, norm__position="pre").function() != base.function()
    assert replaced(base, attention__qk_norm=True).function() != base.function()


def test_resume_differences_name_nested_keys():
    a = Config()
    b = apply_overrides(a, ["model.norm.position=pre", "train.steps=5"])
    assert resume_differences(a, b) == ["model.norm.position: 'post' -> 'pre'"]


def test_flat_items_and_moved_table_agree():
    keys = flat_items(Config())
    for old, new in MOVED.items():
        assert new in keys and old not in keys
