"""`jaxformer.compile_cache`: the persistent compilation cache turned on explicitly, never moved once chosen, and
`jaxformer viz --plot patching` turning it on (its grid and attribution programs compile for seconds).

The suite itself runs with JAX's cache configured (conftest: JAX_COMPILATION_CACHE_DIR), so the first test runs a
child process without it (~3 s): there `enable(folder)` makes a compiled program land in folder, a second
`enable` keeps the first choice, $JAXFORMER_COMPILATION_CACHE is the default folder, and JAX's own setting wins.

Wrong implementations these catch: an enable that sets the folder but not the minimum compile time (a small
program would not be written), one that overrides a cache the user configured, a default that ignores the
environment variable, and viz --plot patching without the cache.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from jaxformer import compile_cache

CHILD = textwrap.dedent("""
    import os, sys, jax
    from pathlib import Path
    from jaxformer import compile_cache
    mine, env, other = (Path(p) for p in sys.argv[1:4])
    assert compile_cache.default_dir() == env, compile_cache.default_dir()
    assert compile_cache.enable(mine) == mine.resolve()
    jax.jit(lambda x: x * 3 + 1)(1.0).block_until_ready()           # compiles in milliseconds: written anyway
    assert [p for p in mine.iterdir() if p.name.startswith("jit_")], list(mine.iterdir())
    assert compile_cache.enable(other) == mine.resolve() and not other.exists()
    print("ok")
""")


def test_enable_writes_programs_to_the_folder_and_keeps_the_first_choice(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")
           and not k.startswith("JAX_PERSISTENT_CACHE")}
    env["JAXFORMER_COMPILATION_CACHE"] = str(tmp_path / "env")
    args = [str(tmp_path / "mine"), str(tmp_path / "env"), str(tmp_path / "other")]
    proc = subprocess.run([sys.executable, "-c", CHILD, *args], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_jax_own_setting_wins_and_the_default_folder(monkeypatch, tmp_path):
    import jax
    before = jax.config.jax_compilation_cache_dir
    assert before                                      # conftest configured one: enable never moves it
    assert compile_cache.enable(tmp_path / "x") == type(tmp_path)(before) and not (tmp_path / "x").exists()
    monkeypatch.delenv(compile_cache.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compile_cache.default_dir() == tmp_path / "jaxformer" / "jax"
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
