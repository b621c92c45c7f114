"""MkDocs hooks (mkdocs.yml `hooks:`): the benchmark reports, benchmarks/results/*.md, become the site's
results/ pages, so that the guide's links to them resolve and `--strict` checks them."""
from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]


def on_files(files, config):
    for report in sorted((ROOT / "benchmarks" / "results").glob("*.md")):
        files.append(File.generated(config, f"results/{report.name}", abs_src_path=str(report)))
    return files
