"""mkdocs hook: the benchmark results (`benchmarks/results/*.md`, with their plots) as pages.

Each results file becomes the page `benchmarks/<name>.md`, listed under Benchmarks in the
navigation after `benchmarks/index.md` (titled by its first heading), so the site shows what
the benchmark scripts last wrote without a copy to keep in step. Links from a results file
into `docs/` are rewritten to the page's place in the site; the Pareto plots are copied beside
the pages.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ROOT / "docs"
SITE_DIR = "benchmarks"  # the pages' folder in the site (docs/benchmarks/ holds index.md)


def result_pages() -> list[Path]:
    """The results files shown as pages, in name order; `readme.md` (the default comparison)
    is shown by `benchmarks/index.md` itself, in its marked blocks."""
    return sorted(p for p in RESULTS.glob("*.md") if p.name != "readme.md")


def rewrite_links(text: str) -> str:
    """Relative Markdown links of a results file, made relative to its page in the site.

    A link into `docs/` points at that page; any other relative link (a plot beside the
    results) is kept, since the plots are copied beside the pages.
    """

    def fix(m: re.Match) -> str:
        label, target = m.group(1), m.group(2)
        if re.match(r"[a-z]+:|#", target):
            return m.group(0)
        path, _, anchor = target.partition("#")
        resolved = (RESULTS / path).resolve()
        if DOCS in resolved.parents:
            rel = os.path.relpath(resolved, DOCS / SITE_DIR).replace(os.sep, "/")
            return f"[{label}]({rel}{'#' + anchor if anchor else ''})"
        return m.group(0)

    return re.sub(r"\[([^\]]*)\]\(([^)\s]+)\)", fix, text)


def nav_title(path: Path) -> str:
    """A results page's navigation title: its first `# ` heading, less the run details the
    scripts append (`Floors (0.10.2, cpu, 1467 s)` -> `Floors`, `Planning cost: <a script>`
    -> `Planning cost`); the file's name where it has no heading."""
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("# "):
            title = re.sub(r"\s*\([^()]*\)$", "", line[2:].strip())  # "(0.10.2, cpu, 368 s)"
            title = re.sub(r":\s*`[^`]*`$", "", title)  # ": `benchmarks/plan_cost.py`"
            return title.strip() or path.stem
    return path.stem


def on_config(config):
    for entry in config["nav"]:
        if isinstance(entry, dict) and "Benchmarks" in entry:
            entry["Benchmarks"] += [{nav_title(p): f"{SITE_DIR}/{p.name}"} for p in result_pages()]
    return config


def on_page_markdown(markdown, page, config, files):
    """`{{ github_repo_url }}` on a page: the repository's address (`extra.github_repo` of
    mkdocs.yml, the one place it is written)."""
    url = f"https://github.com/{config['extra']['github_repo']}"
    return markdown.replace("{{ github_repo_url }}", url)


def on_files(files, config):
    for p in result_pages():
        text = rewrite_links(p.read_text(encoding="utf-8"))
        files.append(File.generated(config, f"{SITE_DIR}/{p.name}", content=text))
    for p in sorted(RESULTS.glob("*.png")):
        files.append(File.generated(config, f"{SITE_DIR}/{p.name}", abs_src_path=str(p)))
    return files
