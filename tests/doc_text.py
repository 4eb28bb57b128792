"""The README's and docs/ pages' text by section, for the tests that run their commands as written."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

HEADING = re.compile(r"^(#{1,6}) (.+)$")


def section(page: str, title: str) -> str:
    """The text under the heading ``title`` of ``page`` (a path from the repository root), up to the next
    heading of the same or a higher level."""
    lines = (REPO / page).read_text().splitlines()
    for i, line in enumerate(lines):
        match = HEADING.match(line)
        if match and match.group(2) == title:
            level = len(match.group(1))
            body = []
            for rest in lines[i + 1:]:
                other = HEADING.match(rest)
                if other and len(other.group(1)) <= level:
                    break
                body.append(rest)
            return "\n".join(body)
    raise AssertionError(f"{page} has no heading {title!r}")


def commands(text: str) -> list[str]:
    """The lines of the text's indented code blocks (four spaces), stripped."""
    return [line.strip() for line in text.splitlines() if line.startswith("    ") and line.strip()]


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as hyphens, a
    repeated heading's anchor suffixed -1, -2, ..."""
    seen: dict[str, int] = {}
    found = set()
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        match = None if fenced else HEADING.match(line)
        if match:
            slug = re.sub(r"[^\w\- ]", "", match.group(2).strip().lower()).replace(" ", "-")
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            found.add(slug if count == 0 else f"{slug}-{count}")
    return found
