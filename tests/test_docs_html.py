"""The site's Markdown renders as it reads: no paragraph that meant to be a list or text.

Python-Markdown (what mkdocs uses) differs from GitHub's CommonMark in two ways that do not
show in an editor: a list needs a blank line before it (else its `* ` markers stay literal
text in the paragraph above), and a line that starts with `>` anywhere starts a blockquote
(`>= 1` wrapped onto the start of a line, `>>>` outside a docstring's `Examples:` section).
This converts every page of the site (docs/**/*.md and the benchmark results pages that
docs/hooks.py adds) and every public docstring (parsed by griffe, as mkdocstrings does) to
HTML with the extensions of mkdocs.yml, without building the site, and fails on:

* a paragraph with a line that starts with a list marker (`* `, `- `, `+ `, `1. `);
* a blockquote whose text starts with `=`, `>` or a digit (a wrapped comparison), or one
  nested directly in another (a `>>>` example rendered as quotes);
* a shell line in a ```bash block wider than the content column (it is cut off on the page).

The Examples pages are checked with the example files docs/hooks.py puts in them, and every
script and notebook of examples/ has its page.
"""

from __future__ import annotations

import html
import inspect
import logging
import re
import sys
from pathlib import Path

import pytest

markdown = pytest.importorskip("markdown")
yaml = pytest.importorskip("yaml")
griffe = pytest.importorskip("griffe")

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = {p.relative_to(DOCS).as_posix(): p for p in sorted(DOCS.rglob("*.md"))}
PAGES |= {
    f"benchmarks/{p.name}": p
    for p in sorted((ROOT / "benchmarks" / "results").glob("*.md"))
    if p.name != "readme.md"  # shown inside benchmarks/index.md, between its markers
}
#: characters of a shell line that fit the content column at the theme's default width
BASH_COLUMNS = 80
#: pages whose numbered lists may interrupt a paragraph: none (listed here, a page is not
#: checked for numbered lists)
ORDERED_LIST_KNOWN: set[str] = set()

sys.path.insert(0, str(DOCS))
import hooks  # noqa: E402  (docs/hooks.py: what the Examples pages include)


def _extensions() -> tuple[list[str], dict]:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    names, configs = [], {}
    for ext in config["markdown_extensions"]:
        if isinstance(ext, dict):
            ((name, options),) = ext.items()
            names.append(name)
            configs[name] = options or {}
        else:
            names.append(ext)
    return names, configs


def to_html(text: str) -> str:
    names, configs = _extensions()
    return markdown.markdown(text, extensions=names, extension_configs=configs)


def _without_autodoc(text: str) -> str:
    """The page less its mkdocstrings directives (`::: name` and the indented options)."""
    return re.sub(r"^::: .*\n(?:[ \t]+.*\n|\n(?=[ \t]))*", "", text, flags=re.M)


def defects(rendered: str, ordered: bool = True) -> list[str]:
    """What in `rendered` (HTML) reads as a list or text but rendered as neither."""
    rendered = re.sub(r"<pre\b.*?</pre>", "", rendered, flags=re.S)  # code blocks
    found = []
    marker = r"[*+-]|\d+\." if ordered else r"[*+-]"
    for para in re.findall(r"<p>(.*?)</p>", rendered, flags=re.S):
        for line in para.splitlines():
            if re.match(rf"\s*(?:{marker})\s", line):
                found.append(f"list marker as text: {html.unescape(line.strip())[:70]!r}")
    for m in re.finditer(r"<blockquote>(.{0,200})", rendered, flags=re.S):
        inner = m[1].lstrip()
        text = html.unescape(re.sub(r"<[^>]+>", "", inner)).lstrip()
        if inner.startswith("<blockquote>"):
            found.append(f"nested blockquote (a `>>>` line?): {text[:60]!r}")
        elif re.match(r"[=>\d]", text):
            found.append(f"blockquote mid-sentence (a line starting '>'): {text[:60]!r}")
    return found


@pytest.mark.parametrize("page", sorted(PAGES))
def test_page_renders_lists_and_text(page):
    text = _without_autodoc(PAGES[page].read_text(encoding="utf-8"))
    text = hooks.INCLUDE.sub(lambda m: hooks.include_markdown(m[1]), text)
    found = defects(to_html(text), ordered=page not in ORDERED_LIST_KNOWN)
    assert not found, (
        f"{page}: {found} (a list needs a blank line before it; reword or rewrap a line that "
        "starts with '>')"
    )


def _docstrings() -> dict[str, str]:
    """The docstrings the API reference shows: `_public_objects` of test_docs.py."""
    from test_docs import _public_objects

    return {q: inspect.getdoc(obj) or "" for q, obj in _public_objects().items()}


def _docstring_markdown(doc: str) -> list[str]:
    """The Markdown pieces mkdocstrings renders of a Google-style docstring."""
    logging.getLogger("griffe").setLevel(logging.ERROR)  # unresolved names: not this test's
    pieces = []
    for section in griffe.Docstring(doc, parser="google").parse():
        value = section.value
        if isinstance(value, str):
            pieces.append(value)
        elif hasattr(value, "contents"):  # an admonition ("Note:", "Example:")
            pieces.append(value.contents)
        elif isinstance(value, list):  # parameters, raises, returns: their descriptions
            pieces += [getattr(item, "description", "") or "" for item in value]
    return pieces


def test_docstrings_render_lists_and_text():
    bad = {}
    for qual, doc in _docstrings().items():
        found = [d for piece in _docstring_markdown(doc) for d in defects(to_html(piece))]
        if found:
            bad[qual] = found
    assert not bad, f"{bad} (`>>>` examples go under an 'Examples:' section)"


def test_shell_lines_fit_the_column():
    wide = []
    for page, path in PAGES.items():
        text = path.read_text(encoding="utf-8")
        for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.M | re.S):
            wide += [f"{page}: {line}" for line in block.splitlines() if len(line) > BASH_COLUMNS]
    assert not wide, f"shell lines over {BASH_COLUMNS} characters (break them with `\\`): {wide}"


def test_every_example_has_a_page():
    included = {m for p in PAGES.values() for m in hooks.INCLUDE.findall(p.read_text())}
    examples = {
        p.relative_to(ROOT).as_posix()
        for p in sorted((ROOT / "examples").rglob("*"))
        if p.suffix in (".py", ".ipynb")
    }
    assert included == examples, (
        f"examples without a page under docs/examples/ or docs/recipes/: {examples - included}"
    )


def test_the_checks_catch_the_defects():
    """Each defect class, as it appeared on the site, is caught; the fixed forms are not."""
    assert defects(to_html("A fraction\n>= 1 for a function."))
    assert defects(to_html("Then they add:\n* **floor**: the step.\n* **plan**: the plan."))
    assert defects(to_html("Example:\n\n    >>> 1 + 1\n\n>>> import jax"))
    assert not defects(to_html("A fraction\nof 1 or more.\n\nThen:\n\n* one\n* two"))
    assert not defects(to_html("> `budget=0.05 is below what jremat's plans reach`"))


#: notes of how the project was worked on (its milestones, "stops", and issue numbers), which
#: belong to the maintainers' pages, not to a user's
PROCESS_NOTE = re.compile(r"\bstops? \d+|\bissues? #?\d+|written, measured, off", re.I)


def _developer_pages() -> set[str]:
    """The pages under the navigation's "Developer notes" section."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    (section,) = [e["Developer notes"] for e in config["nav"] if "Developer notes" in e]
    return {p if isinstance(p, str) else next(iter(p.values())) for p in section}


def test_user_pages_carry_no_process_notes():
    developer = _developer_pages()
    assert "design.md" in developer
    found = [
        f"{page}: {m[0]!r} in {line.strip()[:80]!r}"
        for page, path in PAGES.items()
        if page not in developer
        for line in path.read_text(encoding="utf-8").splitlines()
        for m in PROCESS_NOTE.finditer(line)
    ]
    assert not found, f"process notes on user-facing pages (say what it means for users): {found}"


def test_the_process_note_check_catches_them():
    assert PROCESS_NOTE.search("A second model (stop 44): plans")
    assert PROCESS_NOTE.search("Planning cost (issue 29): on 2-3 CPUs")
    assert PROCESS_NOTE.search("## The aimed search (written, measured, off)")
    assert not PROCESS_NOTE.search("rounds that stop early; see the issue tracker")
