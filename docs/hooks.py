"""mkdocs hook: the benchmark results (`benchmarks/results/*.md`, with their plots) as pages,
the example files on the Examples pages, and the repository's address.

Each results file becomes the page `benchmarks/<name>.md`, listed under Benchmarks in the
navigation after `benchmarks/index.md` (titled by its first heading), so the site shows what
the benchmark scripts last wrote without a copy to keep in step. Links from a results file
into `docs/` are rewritten to the page's place in the site; the Pareto plots are copied beside
the pages.

An Examples page (`docs/examples/*.md`) says `<!-- include: examples/<file> -->` where the
example goes: a script is shown as one Python block, the notebook as its Markdown and code
cells, read from the file when the site is built, so a page never shows an older copy.
`{{ github_repo_url }}` and `{{ github_repo }}` on a page become the repository's address,
written once, as `extra.github_repo` in mkdocs.yml.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ROOT / "docs"
SITE_DIR = "benchmarks"  # the pages' folder in the site (docs/benchmarks/ holds index.md)
INCLUDE = re.compile(r"^<!-- include: (examples/\S+) -->$", re.M)


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


def script_markdown(path: Path) -> str:
    """An example script as one Python block titled with its path."""
    rel = path.relative_to(ROOT).as_posix()
    return f'```python title="{rel}"\n{path.read_text(encoding="utf-8").rstrip()}\n```'


def notebook_markdown(path: Path) -> str:
    """A notebook's cells as Markdown: its text cells with headings one level down (the page
    has its own title; the notebook's `# ` title is left out), its code cells as Python
    blocks; outputs are left out (GitHub and Colab show the saved ones)."""
    out = []
    for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
        source = "".join(cell["source"]).rstrip()
        if cell["cell_type"] == "code":
            out.append(f"```python\n{source}\n```")
        elif cell["cell_type"] == "markdown":
            parts = re.split(r"(^```.*?^```)", source, flags=re.M | re.S)  # fences kept as is
            for i in range(0, len(parts), 2):
                parts[i] = re.sub(r"^# .*\n*", "", parts[i], flags=re.M)
                parts[i] = re.sub(r"^(#{2,5}) ", r"#\1 ", parts[i], flags=re.M)
            out.append("".join(parts).strip())
    return "\n\n".join(part for part in out if part)


def include_markdown(rel: str) -> str:
    """What `<!-- include: rel -->` becomes; a missing file fails the build."""
    path = ROOT / rel
    if not path.is_file():
        raise FileNotFoundError(f"an Examples page includes {rel}, which does not exist")
    return notebook_markdown(path) if path.suffix == ".ipynb" else script_markdown(path)


def on_page_markdown(markdown, page, config, files):
    markdown = INCLUDE.sub(lambda m: include_markdown(m[1]), markdown)
    repo = config["extra"]["github_repo"]
    markdown = markdown.replace("{{ github_repo_url }}", f"https://github.com/{repo}")
    return markdown.replace("{{ github_repo }}", repo)


def on_files(files, config):
    for p in result_pages():
        text = rewrite_links(p.read_text(encoding="utf-8"))
        files.append(File.generated(config, f"{SITE_DIR}/{p.name}", content=text))
    for p in sorted(RESULTS.glob("*.png")):
        files.append(File.generated(config, f"{SITE_DIR}/{p.name}", abs_src_path=str(p)))
    return files
