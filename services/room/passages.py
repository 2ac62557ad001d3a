"""Splitting a text file into searchable passages of about 1,000 characters."""

from __future__ import annotations

import re

PASSAGE_CHARS = 1000
_PARAGRAPH_BREAK = re.compile(r"\n\s*\n")


def split_passages(text: str, limit: int = PASSAGE_CHARS) -> list[str]:
    """Passages of at most ``limit`` characters, cut at paragraph, then line, then word boundaries."""
    pieces: list[str] = []
    for paragraph in _PARAGRAPH_BREAK.split(text.replace("\r\n", "\n")):
        paragraph = paragraph.strip()
        if paragraph:
            pieces.extend(_fit(paragraph, limit))
    passages: list[str] = []
    current = ""
    for piece in pieces:
        if current and len(current) + 2 + len(piece) <= limit:
            current = f"{current}\n\n{piece}"
            continue
        if current:
            passages.append(current)
        current = piece
    if current:
        passages.append(current)
    return passages


def _fit(paragraph: str, limit: int) -> list[str]:
    """A paragraph as pieces of at most ``limit`` characters: whole lines first, then words."""
    if len(paragraph) <= limit:
        return [paragraph]
    out: list[str] = []
    current = ""
    for line in paragraph.split("\n"):
        line = line.strip()
        if not line:
            continue
        for part in _cut_line(line, limit):
            if current and len(current) + 1 + len(part) <= limit:
                current = f"{current}\n{part}"
                continue
            if current:
                out.append(current)
            current = part
    if current:
        out.append(current)
    return out


def _cut_line(line: str, limit: int) -> list[str]:
    """A line longer than ``limit`` cut at the last space before it (or at ``limit`` when there is none)."""
    parts: list[str] = []
    start = 0
    while len(line) - start > limit:
        cut = line.rfind(" ", start, start + limit + 1)
        if cut <= start:
            cut = start + limit
        parts.append(line[start:cut].rstrip())
        start = cut
        while start < len(line) and line[start] == " ":
            start += 1
    if start < len(line):
        parts.append(line[start:])
    return parts
