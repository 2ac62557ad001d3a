"""The Room's hot-path conversions: timestamps as protobuf's own conversion gives them, ids in
canonical form as uuid gives them."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta, timezone

import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from quayutec.errors import InvalidArgument
from services.room import convert, validate


@pytest.mark.parametrize(
    "dt",
    [
        datetime(2026, 12, 4, 19, 59, 1, 123456, tzinfo=UTC),
        datetime(1969, 12, 31, 23, 59, 59, 1, tzinfo=timezone(timedelta(hours=-5))),
        datetime(2026, 1, 1, 0, 0, 0, 999999, tzinfo=timezone(timedelta(hours=9, minutes=30))),
        datetime(2026, 1, 1, 0, 0, 0, 999999),  # naive: taken as UTC, as protobuf does
        datetime(1, 1, 1, tzinfo=UTC),
        datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
    ],
)
def test_timestamp_matches_protobuf(dt: datetime) -> None:
    expected = Timestamp()
    expected.FromDatetime(dt)
    got = convert.timestamp(dt)
    assert got == expected
    assert got is not None and got.ToDatetime(tzinfo=UTC) == expected.ToDatetime(tzinfo=UTC)


def test_no_timestamp_for_none() -> None:
    assert convert.timestamp(None) is None


@pytest.mark.parametrize(
    "value",
    [
        "0b8e5a8c-3f4e-4b7a-9d2c-1a2b3c4d5e6f",  # canonical: returned as it is
        "0B8E5A8C-3F4E-4B7A-9D2C-1A2B3C4D5E6F",
        "{0b8e5a8c-3f4e-4b7a-9d2c-1a2b3c4d5e6f}",
        "0b8e5a8c3f4e4b7a9d2c1a2b3c4d5e6f",
        "urn:uuid:0b8e5a8c-3f4e-4b7a-9d2c-1a2b3c4d5e6f",
    ],
)
def test_required_id_is_canonical(value: str) -> None:
    assert validate.required_id(value, "id") == str(uuid.UUID(value))


@pytest.mark.parametrize(
    "value", ["0b8e5a8c-3f4e-4b7a-9d2c-1a2b3c4d5e6f\n", "0b8e5a8c-3f4e-4b7a-9d2c-1a2b3c4d5e6", "not-an-id"]
)
def test_required_id_refuses_what_is_not_an_id(value: str) -> None:
    with pytest.raises(InvalidArgument):
        validate.required_id(value, "id")
