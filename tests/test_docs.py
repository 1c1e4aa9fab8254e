"""The documentation builds: MkDocs in strict mode, so a broken link or anchor, a page missing from the
navigation, or a benchmarks page whose results section is older than ``benchmarks/results`` fails."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_documentation_builds_in_strict_mode(tmp_path):
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    home = (tmp_path / "site" / "index.html").read_text()
    assert "A five-minute tour" in home  # the README is the home page
    assert (tmp_path / "site" / "benchmarks" / "results" / "keyed_full.png").exists()


def test_the_readme_is_a_guide_that_fits_on_a_few_screens():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 400, f"README.md has {len(lines)} lines: move detail to docs/"
    assert lines[2:6] == ["```bash", lines[3], lines[4], "```"] and lines[3].startswith("./run main")
