"""JAX's persistent compilation cache, turned on explicitly: a program compiled once is loaded from disk by every
later process that builds the same program (the same model structure, shapes, site and metric function).

What it saves is measured in benchmarks/results/patching_tl.md (the first call of the patching grid and of
attribution patching in a fresh process, with an empty and with a warm cache). Sweeps turn it on for their runs
(`jaxformer.sweep`); `jaxformer.patching`'s guide shows it for notebooks. Nothing turns it on by importing.
"""
from __future__ import annotations

import os
from pathlib import Path

ENV = "JAXFORMER_COMPILATION_CACHE"


def default_dir() -> Path:
    """Where `enable()` puts the cache without an argument: $JAXFORMER_COMPILATION_CACHE, else
    $XDG_CACHE_HOME/jaxformer/jax (~/.cache/jaxformer/jax).

    Returns:
      The cache folder (not created).

    Examples:
      >>> import os
      >>> from jaxformer.compile_cache import default_dir
      >>> os.environ["JAXFORMER_COMPILATION_CACHE"] = "/tmp/my-cache"
      >>> str(default_dir())
      '/tmp/my-cache'
      >>> del os.environ["JAXFORMER_COMPILATION_CACHE"]
    """
    if os.environ.get(ENV):
        return Path(os.environ[ENV]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jaxformer" / "jax"


def enable(folder: str | Path | None = None, *, min_compile_secs: float = 0.0) -> Path:
    """Point JAX's persistent compilation cache at `folder` unless the process has one configured already (JAX's
    own `jax_compilation_cache_dir` / $JAX_COMPILATION_CACHE_DIR win: a cache the user chose is never moved).

    Call it before the first compilation it should serve; a program compiled before is compiled again, once.

    Args:
      folder: the cache folder (created by JAX on the first write); None: `default_dir()`.
      min_compile_secs: programs that compile faster than this are not written (0: every program).

    Returns:
      The folder in use: `folder`, or the one configured before this call.

    Raises:
      ValueError: min_compile_secs is negative.

    Examples:
      >>> import tempfile, jax
      >>> from jaxformer.compile_cache import enable
      >>> before = jax.config.jax_compilation_cache_dir               # (this example undoes itself at the end)
      >>> where = enable(tempfile.mkdtemp())           # a later process passing the same folder loads from it
      >>> str(where) == jax.config.jax_compilation_cache_dir
      True
      >>> enable("/elsewhere") == where                  # the first choice stays
      True
      >>> jax.config.update("jax_compilation_cache_dir", before)
    """
    import jax
    if min_compile_secs < 0:
        raise ValueError(f"min_compile_secs={min_compile_secs} must be >= 0")
    if jax.config.jax_compilation_cache_dir is None:
        jax.config.update("jax_compilation_cache_dir", str(Path(default_dir() if folder is None else folder)
                                                           .expanduser().resolve()))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_secs))
    return Path(jax.config.jax_compilation_cache_dir)
