"""The Markdown a user reads (``README.md``, ``docs/*.md``, ``benchmarks/README.md``) as the tests see it: fenced
code blocks, the block under a heading, headings with their GitHub anchors, and relative links. One parser for
every test that checks what the docs show (tests/test_readme_blocks.py, test_docs.py, test_example_plugins.py,
test_readme_and_ignores.py, test_netns_grpo.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

_FENCE = re.compile(r"^```(\w*)[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


@dataclass(frozen=True)
class Block:
    """One fenced code block: its language tag, its text and the 1-based line of its opening fence."""

    lang: str
    code: str
    line: int


def markdown_files() -> list[str]:
    """Every Markdown file a user is pointed to, relative to the repository root."""
    docs = sorted(p.relative_to(REPO_ROOT).as_posix() for p in (REPO_ROOT / "docs").glob("*.md"))
    return ["README.md", *docs, "benchmarks/README.md"]


def text(rel: str = "README.md") -> str:
    return (REPO_ROOT / rel).read_text(encoding="utf-8")


def blocks(rel: str = "README.md") -> list[Block]:
    """Every fenced code block of ``rel``, in order."""
    src = text(rel)
    return [Block(m.group(1), m.group(2), src.count("\n", 0, m.start()) + 1) for m in _FENCE.finditer(src)]


def block(heading: str, lang: str, rel: str = "README.md") -> str:
    """The first fenced ``lang`` block after the heading ``heading`` (any level) of ``rel``."""
    match = re.search(rf"^#+ {re.escape(heading)}\s*$(.*?)^```{lang}\n(.*?)^```", text(rel), re.S | re.M)
    assert match, f"{rel} has no ```{lang} block under a heading {heading!r}"
    return match.group(2)


def section(heading: str, rel: str = "README.md") -> str:
    """The text under the heading ``heading`` of ``rel`` up to the next heading of the same or a higher level."""
    src = text(rel)
    match = re.search(rf"^(#+) {re.escape(heading)}\s*$", _prose(src), re.M)
    assert match, f"{rel} has no heading {heading!r}"
    level = len(match.group(1))
    end = re.compile(rf"^#{{1,{level}}} ", re.M).search(_prose(src), match.end())
    return src[match.end() : end.start() if end else len(src)]


def _prose(src: str) -> str:
    """``src`` with every fenced block's lines blanked (same offsets), so a ``# comment`` is not a heading."""
    return _FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), src)


def slug(title: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def anchors(rel: str) -> set[str]:
    """The anchors of every heading of ``rel`` (a repeated title gets ``-1``, ``-2``... as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    for title in re.findall(r"^#+ (.+?)\s*$", _prose(text(rel)), re.M):
        base = slug(title)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(rel: str) -> list[tuple[str, str]]:
    """(target path, anchor) of every relative link in the prose of ``rel``; the path is relative to the repository
    root ('' for an anchor in ``rel`` itself becomes ``rel``)."""
    out = []
    base = (REPO_ROOT / rel).parent
    for target in _LINK.findall(_prose(text(rel))):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (base / path).resolve() if path else (REPO_ROOT / rel).resolve()
        try:
            shown = resolved.relative_to(REPO_ROOT).as_posix()
        except ValueError:
            shown = str(resolved)  # outside the repository: reported as missing by the caller
        out.append((shown, anchor))
    return out
