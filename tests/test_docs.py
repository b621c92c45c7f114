"""The documentation: the README stays short and its code is the tested snippet, the snippet runs, every page in
docs/guide is in the site's navigation, every ablation report is listed, and (where MkDocs is installed: the
`docs` extra, which CI installs) the site builds with --strict: a broken link, a missing page or an API reference
that cannot be resolved fails.

Wrong implementations these catch: a README that grows back past 200 lines, a README code block edited apart from
the file that is run, a guide page or a report that no navigation reaches, a link renamed on one side only.
"""
from __future__ import annotations

import re
import runpy
import shutil
import subprocess

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


@pytest.mark.skipif(shutil.which("mkdocs", path=str(ROOT / ".venv" / "bin")) is None and
                    shutil.which("mkdocs") is None, reason="MkDocs is not installed (the docs extra: make docs)")
def test_the_site_builds_strict(tmp_path):
    exe = shutil.which("mkdocs", path=str(ROOT / ".venv" / "bin")) or shutil.which("mkdocs")
    proc = subprocess.run([exe, "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env={"NO_MKDOCS_2_WARNING": "1",
                                                                            "PATH": "/usr/bin:/bin",
                                                                            "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "site" / "api" / "ops" / "index.html").exists()
    assert "ring_attention" in (tmp_path / "site" / "api" / "ops" / "index.html").read_text(encoding="utf-8")
