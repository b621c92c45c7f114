"""`jaxformer.compile_cache`: the persistent compilation cache turned on explicitly, never moved once chosen, and
`jaxformer viz --plot patching` turning it on (its grid and attribution programs compile for seconds).

The suite itself runs with JAX's cache configured (conftest: JAX_COMPILATION_CACHE_DIR), so the first tests take
it away for their duration (`no_cache`, restored after; in this process, so that the mutation tool credits
them): `enable(folder)` makes a compiled program land in folder, a second `enable` keeps the first choice,
$JAXFORMER_COMPILATION_CACHE is the default folder (~ expanded), and JAX's own setting wins.

Wrong implementations these catch: an enable that sets the folder but not the minimum compile time (a small
program would not be written), one that overrides a cache the user configured, a default that ignores the
environment variable, and viz --plot patching without the cache.
"""
from __future__ import annotations

import pytest

from jaxformer import compile_cache

@pytest.fixture
def no_cache():
    """This process without a compilation cache for the test (conftest configured one), restored after it; JAX's
    cache object is reset on both sides so that each folder is the one written (jax's own reset_cache)."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache as cc
    saved = {k: getattr(jax.config, k) for k in ("jax_compilation_cache_dir",
                                                 "jax_persistent_cache_min_compile_time_secs")}
    jax.config.update("jax_compilation_cache_dir", None)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)      # JAX's default
    cc.reset_cache()
    try:
        yield
    finally:
        for k, v in saved.items():
            jax.config.update(k, v)
        cc.reset_cache()


def test_enable_writes_programs_to_the_folder_and_keeps_the_first_choice(no_cache, tmp_path, monkeypatch):
    import jax
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "env"))
    assert compile_cache.default_dir() == tmp_path / "env"
    mine = tmp_path / "mine"
    assert compile_cache.enable(mine) == mine.resolve()
    assert jax.config.jax_compilation_cache_dir == str(mine.resolve())
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0
    jax.jit(lambda x: x * 3 + 1)(1.0).block_until_ready()       # compiles in milliseconds: written anyway
    assert [p for p in mine.iterdir() if p.name.startswith("jit_")], list(mine.iterdir())
    assert compile_cache.enable(tmp_path / "other") == mine.resolve() and not (tmp_path / "other").exists()


def test_enable_without_a_folder_takes_the_default_and_a_threshold(no_cache, tmp_path, monkeypatch):
    import jax
    monkeypatch.setenv(compile_cache.ENV, "~/x-cache")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert compile_cache.enable(min_compile_secs=2) == tmp_path / "x-cache"        # ~ expanded
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 2.0


def test_jax_own_setting_wins_and_the_default_folder(monkeypatch, tmp_path):
    import jax
    before = jax.config.jax_compilation_cache_dir
    assert before                                      # conftest configured one: enable never moves it
    assert compile_cache.enable(tmp_path / "x") == type(tmp_path)(before) and not (tmp_path / "x").exists()
    monkeypatch.delenv(compile_cache.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compile_cache.default_dir() == tmp_path / "jaxformer" / "jax"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compile_cache.default_dir() == tmp_path / "home" / ".cache" / "jaxformer" / "jax"
    with pytest.raises(ValueError, match="min_compile_secs=-1"):
        compile_cache.enable(tmp_path, min_compile_secs=-1)


def test_viz_patching_turns_the_cache_on_and_other_plots_do_not(monkeypatch):
    from jaxformer import cli, viz, viz_patching
    calls = []
    monkeypatch.setattr(compile_cache, "enable", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(viz, "write_heatmaps", lambda *a, **k: [])
    monkeypatch.setattr(viz, "write_probes", lambda *a, **k: [])
    monkeypatch.setattr(viz_patching, "write_patching", lambda *a, **k: [])
    base = dict(workdir="RUN", prompt=["ab"], which="best", out=None, weights=None, corrupt="ac", site=None,
                over="position")
    assert cli.cmd_viz(type("A", (), dict(base, plot=["lens"]))) == 0 and calls == []
    assert cli.cmd_viz(type("A", (), dict(base, plot=["patching"]))) == 0 and calls == [()]
