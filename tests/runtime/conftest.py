"""Fixtures for the Runtime's model-call tests: a real stand-in provider on an ephemeral port."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from services.runtime.standin import StandinProvider


@pytest.fixture
def standin() -> Iterator[StandinProvider]:
    with StandinProvider() as provider:
        yield provider
