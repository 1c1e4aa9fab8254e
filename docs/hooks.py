"""MkDocs hooks: the README is the site's home page, and the benchmark plots (beside their JSON in
``benchmarks/results``) are part of the site.

The results section of the benchmarks page must be what ``benchmarks/report.py`` makes of the results now.
The README links the pages as ``docs/<page>.md``, as they are in the repository; as the home page
(``index.md``) it links them as ``<page>.md``.

The pages link them as ``../benchmarks/results/<name>.png`` (so they also show when a page is read in the
repository); the build publishes each as ``benchmarks/results/<name>.png`` of the site and rewrites the links
to it, so a missing plot fails the build like a missing page.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PREFIX = "../benchmarks/results/"


def on_pre_build(config):
    """Fail the build when the results section of ``benchmarks.md`` is not what ``benchmarks/report.py`` makes of
    ``benchmarks/results`` now (a number typed by hand, or a benchmark rerun without ``./run bench report``)."""
    import sys

    sys.path.insert(0, str(ROOT))
    from benchmarks import report

    page = report.PAGE.read_text()
    if report.updated_page(page, report.render()) != page:
        raise PluginError(f"{report.PAGE} is out of date with benchmarks/results: run ./run bench report")


def on_files(files, config):
    for plot in sorted(RESULTS.glob("*.png")):
        files.append(
            File(
                f"benchmarks/results/{plot.name}",
                str(RESULTS.parent.parent),
                config["site_dir"],
                config["use_directory_urls"],
            )
        )
    return files


def on_page_markdown(markdown, page, config, files):
    return markdown.replace(f"]({PREFIX}", "](benchmarks/results/")


def on_page_read_source(page, config):
    if page.file.src_uri == "index.md":
        return (ROOT / "README.md").read_text().replace("](docs/", "](")
    return None
