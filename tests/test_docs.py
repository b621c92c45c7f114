"""The documentation: the README stays short and its code is the tested snippet, the snippet runs, every page in
docs/guide is in the site's navigation, every ablation report is listed, and (where MkDocs is installed: the
`docs` extra, which CI installs; slow lane) the site builds with --strict: a broken link, a missing page or an API reference
that cannot be resolved fails.

Wrong implementations these catch: a README that grows back past 200 lines, a README code block edited apart from
the file that is run, a guide page or a report that no navigation reaches, a link renamed on one side only.
"""
from __future__ import annotations

import re
import runpy
import shutil
import subprocess

import numpy as np
import pytest

from helpers import ROOT

README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_the_readme_is_short_and_links_into_the_guide():
    assert len(README.splitlines()) <= 200
    for page in sorted((ROOT / "docs" / "guide").glob("*.md")):
        assert f"docs/guide/{page.name}" in README, page.name


def test_the_readme_code_is_the_snippet_the_suite_runs(capsys):
    taste = (ROOT / "docs" / "snippets" / "taste.py").read_text(encoding="utf-8").strip()
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    assert [b.strip() for b in blocks] == [taste]
    runpy.run_path(str(ROOT / "docs" / "snippets" / "taste.py"), run_name="__main__")
    assert capsys.readouterr().out.split("\n")[:2] == ["(2, 16, 64) (2, 2, 16, 64)", "(2, 8)"]


def test_every_page_is_in_the_navigation_and_every_report_listed():
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    for page in sorted((ROOT / "docs" / "guide").glob("*.md")):
        assert f"guide/{page.name}" in nav, page.name
    index = (ROOT / "docs" / "ablations" / "index.md").read_text(encoding="utf-8")
    for report in sorted((ROOT / "docs" / "ablations").glob("*.md")):
        assert report.name == "index.md" or f"]({report.name})" in index, report.name


@pytest.mark.slow          # ~6 s; CI's last step builds the same site --strict with the tutorials executed (make docs)
@pytest.mark.skipif(shutil.which("mkdocs", path=str(ROOT / ".venv" / "bin")) is None and
                    shutil.which("mkdocs") is None, reason="MkDocs is not installed (the docs extra: make docs)")
def test_the_site_builds_strict(tmp_path):
    exe = shutil.which("mkdocs", path=str(ROOT / ".venv" / "bin")) or shutil.which("mkdocs")
    proc = subprocess.run([exe, "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                          capture_output=True, text=True, timeout=600,
                          env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT),
                               "JAXFORMER_DOCS_EXECUTE": "false"})        # tutorials rendered, not run (the slow lane runs them)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "site" / "api" / "ops" / "index.html").exists()
    assert "ring_attention" in (tmp_path / "site" / "api" / "ops" / "index.html").read_text(encoding="utf-8")


def _guide_blocks() -> list[tuple[str, str]]:
    return [(page.name, block) for page in sorted((ROOT / "docs" / "guide").glob("*.md"))
            for block in re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S)]


def test_every_python_block_of_the_guide_runs(tmp_path):
    """Each ```python block of docs/guide/ runs as written, in a namespace holding what its prose names: `model`
    (a 3-layer, 4-head decoder that the Hugging Face export expresses), `tokens`, `mask`, `targets`, `clean`,
    `corrupt`, `metric`, `features`, `labels`, `train_rows`; "path/to/checkpoint" and "out/" point into tmp."""
    import jax
    import jax.numpy as jnp
    from jaxformer.config import ModelConfig, replaced
    from jaxformer.hf import save_pretrained
    from jaxformer.nn import build_model
    cfg = replaced(ModelConfig(), arch="decoder_only", vocab_size=32, d_model=32, num_heads=4, num_kv_heads=2,
                   d_ff=64, num_decoder_layers=3, positional="rope", norm__position="pre", norm__type="rmsnorm",
                   activation="swiglu", use_bias=False, tie_embeddings=False, scale_embeddings=False, pad_id=-1,
                   runtime__dropout=0.0)
    model = build_model(cfg, seed=0)
    save_pretrained(model, tmp_path / "checkpoint")
    tokens = jax.random.randint(jax.random.key(0), (4, 8), 1, 32)
    features = jnp.asarray(np.random.default_rng(0).standard_normal((3, 40, 32)), jnp.float32)
    blocks = _guide_blocks()
    assert len(blocks) >= 3
    for page, block in blocks:
        code = block.replace("path/to/checkpoint", str(tmp_path / "checkpoint")).replace('"out/"',
                                                                                         repr(str(tmp_path / "out")))
        namespace = {"jnp": jnp, "model": model, "tokens": tokens, "mask": jnp.ones_like(tokens),
                     "targets": jnp.roll(tokens, -1, axis=1), "clean": tokens, "corrupt": tokens.at[:, 3].set(5),
                     "metric": lambda logits: jnp.mean(logits[:, -1, 3] - logits[:, -1, 4]), "features": features,
                     "labels": jnp.arange(40) % 3, "train_rows": jnp.arange(40) < 30}
        exec(compile(code, f"docs/guide/{page}", "exec"), namespace)          # noqa: S102 (the docs' own code)


def _commands() -> list[tuple[str, list[str]]]:
    """Every `.venv/bin/jaxformer ...` line of the README's and the guide's bash blocks (continuations joined,
    comments and `&&` chains split) -> (page, argv)."""
    import shlex
    pages = [ROOT / "README.md", *sorted((ROOT / "docs" / "guide").glob("*.md"))]
    out = []
    for page in pages:
        for block in re.findall(r"```bash\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                for part in line.split("#")[0].split("&&"):
                    words = shlex.split(part)
                    if words and words[0].endswith("bin/jaxformer"):
                        out.append((page.name, words[1:]))
    return out


def test_every_command_shown_parses_with_the_cli(capsys):
    """The commands the README and the guide show are the CLI's: each parses (subcommand, flags, choices),
    nothing is run. A flag renamed in the CLI and not in the docs fails here."""
    from jaxformer.cli_parser import parser
    commands = _commands()
    assert len(commands) >= 20
    for page, argv in commands:
        try:
            parser().parse_args(argv)
        except SystemExit as e:                          # argparse's refusal: name the page and the command
            raise AssertionError(f"{page}: jaxformer {' '.join(argv)}: {capsys.readouterr().err}") from e
