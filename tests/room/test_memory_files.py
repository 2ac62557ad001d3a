"""Shared memory (visibility and full-text search) and files split into searchable passages."""

from __future__ import annotations

import uuid
from typing import Any

import grpc

from quayutec.v1 import common_pb2, room_pb2
from services.room.passages import split_passages
from tests.room.conftest import Stub, World, agent_author, expect_error, person

INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND
ROOM_WIDE = common_pb2.MEMORY_VISIBILITY_ROOM
PRIVATE = common_pb2.MEMORY_VISIBILITY_COMPANY
MISSING = str(uuid.uuid4())


async def remember(room: Stub, world: World, text: str, visibility: Any = ROOM_WIDE, **fields: Any) -> Any:
    fields.setdefault("author", person(world.acme.company_id))
    fields.setdefault("room_id", world.room_id)
    request = room_pb2.RoomServiceWriteMemoryRequest(text=text, visibility=visibility, **fields)
    return await room.WriteMemory(request)


async def read(room: Stub, world: World, company_id: str, query: str = "", **fields: Any) -> list[str]:
    request = room_pb2.RoomServiceListMemoryRequest(
        room_id=world.room_id, reader_company_id=company_id, query=query, **fields
    )
    return [line.text for line in (await room.ListMemory(request)).lines]


async def test_private_memory_is_invisible_to_other_companies(room: Stub, world: World) -> None:
    """Guards the Room's own filter, the one place the rule lives: it reads through the Room
    directly, so a leak in the Room fails here. The Gateway's test of the same promise
    (tests/gateway/test_api.py::test_private_memory_reaches_only_its_company) cannot see such a leak,
    because the Gateway drops another company's private lines again (defence in depth)."""
    await remember(room, world, "launch date is May 4")
    await remember(room, world, "our floor price is 90", PRIVATE)
    await remember(room, world, "bolt budget is 120", PRIVATE, author=agent_author(world.bolt_agent), run_id="r1")
    assert await read(room, world, world.acme.company_id) == ["our floor price is 90", "launch date is May 4"]
    assert await read(room, world, world.bolt.company_id) == ["bolt budget is 120", "launch date is May 4"]
    assert await read(room, world, world.bolt.company_id, "price") == []
    assert await read(room, world, world.acme.company_id, "prices") == ["our floor price is 90"]
    # A company outside the room reads nothing, not even room-wide lines.
    await expect_error(
        NOT_FOUND,
        room.ListMemory(
            room_pb2.RoomServiceListMemoryRequest(room_id=world.room_id, reader_company_id=world.crow.company_id)
        ),
    )


async def test_memory_full_text_search_and_paging(room: Stub, world: World) -> None:
    for text in ("the launch moved to June", "pricing meeting on Monday", "launch checklist is ready", "lunch at 12"):
        await remember(room, world, text)
    acme = world.acme.company_id
    assert await read(room, world, acme, "launch") == ["launch checklist is ready", "the launch moved to June"]
    assert await read(room, world, acme, '"launch checklist"') == ["launch checklist is ready"]
    assert await read(room, world, acme, "launch -june") == ["launch checklist is ready"]
    assert await read(room, world, acme, "launching") == ["launch checklist is ready", "the launch moved to June"]
    first = await room.ListMemory(
        room_pb2.RoomServiceListMemoryRequest(room_id=world.room_id, reader_company_id=acme, page_size=3)
    )
    rest = await room.ListMemory(
        room_pb2.RoomServiceListMemoryRequest(
            room_id=world.room_id, reader_company_id=acme, page_size=3, page_token=first.next_page_token
        )
    )
    assert [line.text for line in (*first.lines, *rest.lines)] == [
        "lunch at 12",
        "launch checklist is ready",
        "pricing meeting on Monday",
        "the launch moved to June",
    ]
    assert not rest.next_page_token


async def test_memory_dedupe_and_errors(room: Stub, world: World) -> None:
    first = await remember(room, world, "note", dedupe_key="run:r1:memory:0")
    again = await remember(room, world, "other", dedupe_key="run:r1:memory:0")
    assert again.deduplicated and again.line == first.line and not first.deduplicated
    assert first.line.visibility == ROOM_WIDE and first.line.author.person == "ana"
    await expect_error(INVALID, remember(room, world, ""), "text")
    await expect_error(INVALID, remember(room, world, "x" * (16 * 1024 + 1)), "text")
    await expect_error(INVALID, remember(room, world, "x", common_pb2.MEMORY_VISIBILITY_UNSPECIFIED), "visibility")
    await expect_error(
        grpc.StatusCode.PERMISSION_DENIED, remember(room, world, "x", author=person(world.crow.company_id))
    )
    await expect_error(NOT_FOUND, remember(room, world, "x", room_id=MISSING))
    await expect_error(INVALID, read(room, world, ""), "reader_company_id")
    await expect_error(INVALID, read(room, world, world.acme.company_id, page_token="x"), "page_token")
    assert await read(room, world, world.acme.company_id) == ["note"]


async def upload(room: Stub, world: World, name: str, content: bytes, **fields: Any) -> Any:
    fields.setdefault("author", person(world.acme.company_id))
    fields.setdefault("room_id", world.room_id)
    request = room_pb2.RoomServiceUploadFileRequest(name=name, content_type="text/plain", content=content, **fields)
    return await room.UploadFile(request)


def test_split_passages_keeps_to_the_size_on_boundaries() -> None:
    paragraphs = [f"Paragraph {i}. " + "word " * 60 for i in range(30)]
    passages = split_passages("\n\n".join(paragraphs))
    assert all(len(p) <= 1000 for p in passages) and len(passages) < 30
    assert all(p.startswith("Paragraph") for p in passages)  # cut between paragraphs, not inside
    long_line = "x" * 2500
    assert [len(p) for p in split_passages(long_line)] == [1000, 1000, 500]
    lines = "\n".join(f"line {i} " + "y" * 90 for i in range(25))
    assert all(len(p) <= 1000 and p.startswith("line") for p in split_passages(lines))
    assert split_passages("") == [] and split_passages("\n\n  \n") == []


async def test_upload_and_search_passages_best_first(room: Stub, world: World) -> None:
    handbook = "\n\n".join(
        [
            "Refund policy: customers may ask for a refund within 30 days of purchase.",
            "Shipping takes five days. " + "Filler sentence about logistics. " * 40,
            "Refund requests for refund-eligible items: refund processed to the original card, refund confirmed.",
        ]
    ).encode()
    made = (await upload(room, world, "handbook.md", handbook)).file
    assert made.name == "handbook.md" and made.size_bytes == len(handbook) and made.passage_count >= 2
    await upload(room, world, "other.txt", b"nothing relevant here")
    found = await room.SearchPassages(room_pb2.RoomServiceSearchPassagesRequest(room_id=world.room_id, query="refund"))
    assert found.passages and all("refund" in p.text.lower() for p in found.passages)
    ranks = [p.rank for p in found.passages]
    assert ranks == sorted(ranks, reverse=True) and ranks[0] > ranks[-1]
    assert "refund processed" in found.passages[0].text and found.passages[0].file_name == "handbook.md"
    # A long natural-language query with words no passage has still finds the passages with some of them.
    loose = await room.SearchPassages(
        room_pb2.RoomServiceSearchPassagesRequest(
            room_id=world.room_id, query="what is our refund window for unhappy customers", limit=1
        )
    )
    assert len(loose.passages) == 1 and "refund" in loose.passages[0].text.lower()
    none = await room.SearchPassages(room_pb2.RoomServiceSearchPassagesRequest(room_id=world.room_id, query="zebra"))
    assert list(none.passages) == []
    listed = await room.ListFiles(room_pb2.RoomServiceListFilesRequest(room_id=world.room_id, page_size=1))
    rest = await room.ListFiles(
        room_pb2.RoomServiceListFilesRequest(room_id=world.room_id, page_size=1, page_token=listed.next_page_token)
    )
    assert [f.name for f in (*listed.files, *rest.files)] == ["handbook.md", "other.txt"]


async def test_file_errors(room: Stub, world: World) -> None:
    await expect_error(INVALID, upload(room, world, "", b"x"), "name")
    await expect_error(INVALID, upload(room, world, "big.txt", b"a" * (10 * 1024 * 1024 + 1)), "10 MiB")
    await expect_error(INVALID, upload(room, world, "bin.dat", b"\xff\xfe\x00binary"), "UTF-8")
    await expect_error(INVALID, upload(room, world, "nul.txt", b"a\x00b"), "NUL")
    await expect_error(
        grpc.StatusCode.PERMISSION_DENIED, upload(room, world, "a.txt", b"a", author=person(world.crow.company_id))
    )
    await expect_error(NOT_FOUND, upload(room, world, "a.txt", b"a", room_id=MISSING))
    await expect_error(NOT_FOUND, room.ListFiles(room_pb2.RoomServiceListFilesRequest(room_id=MISSING)))
    search = room_pb2.RoomServiceSearchPassagesRequest
    await expect_error(INVALID, room.SearchPassages(search(room_id=world.room_id, query="")), "query")
    await expect_error(INVALID, room.SearchPassages(search(room_id=world.room_id, query="a", limit=51)), "limit")
    await expect_error(NOT_FOUND, room.SearchPassages(search(room_id=MISSING, query="a")))
    ok = await upload(room, world, "exactly.txt", b"a" * (10 * 1024 * 1024))
    assert ok.file.size_bytes == 10 * 1024 * 1024
