"""docs/console.md shows every console page at a desktop's size and a phone's: each image it refers to
exists, is a PNG, and is small; no screenshot in docs/images is left unreferenced."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"
CONSOLE = DOCS / "console.md"
IMAGES = DOCS / "images"
MOST_BYTES = 150_000
PAGES = (
    "signin",
    "room",
    "message",
    "approvals",
    "runs",
    "run",
    "agents",
    "rights",
    "keys",
    "invitations",
    "not-found",
)


def referenced() -> set[str]:
    return set(re.findall(r"\]\((images/[^)\s]+\.png)\)", CONSOLE.read_text()))


def test_every_image_docs_console_refers_to_exists_and_is_small() -> None:
    found = referenced()
    assert found
    for ref in sorted(found):
        path = DOCS / ref
        assert path.is_file(), f"docs/console.md refers to {ref}, which does not exist"
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{ref} is not a PNG"
        assert len(data) <= MOST_BYTES, f"{ref} is {len(data)} bytes; keep screenshots under {MOST_BYTES}"


def test_each_page_is_shown_at_desktop_and_phone_size_and_nothing_is_left_over() -> None:
    found = referenced()
    for page in PAGES:
        assert {f"images/console-{page}.png", f"images/console-{page}-phone.png"} <= found, page
    assert {f"images/{p.name}" for p in IMAGES.glob("*.png")} == found
