"""gRPC adapter of ClaimsService: validate ids, call the store, answer."""

from __future__ import annotations

from datetime import datetime

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from quayutec.errors import InvalidArgument, NotFound
from quayutec.telemetry import annotate
from quayutec.v1 import claims_pb2, claims_pb2_grpc
from services.claims.store import ClaimStore

MAX_ID_BYTES = 200
# Most items of one ClaimMany call (they go in one statement).
MAX_CLAIM_MANY_ITEMS = 1000


class ClaimsServicer(claims_pb2_grpc.ClaimsServiceServicer):
    """ClaimOnce, ClaimMany and GetClaim over a ``ClaimStore``."""

    def __init__(self, store: ClaimStore) -> None:
        self._store = store

    async def ClaimOnce(
        self, request: claims_pb2.ClaimOnceRequest, context: grpc.aio.ServicerContext
    ) -> claims_pb2.ClaimOnceResponse:
        agent_id, wake_id = _ids(request.agent_id, request.wake_id)
        claimant = request.claimant
        if claimant:
            validate_id("claimant", claimant)
        claim = await self._store.claim_once(agent_id, wake_id, claimant)
        return claims_pb2.ClaimOnceResponse(claimed=claim.claimed, claimed_at=_timestamp(claim.claimed_at))

    async def ClaimMany(
        self, request: claims_pb2.ClaimManyRequest, context: grpc.aio.ServicerContext
    ) -> claims_pb2.ClaimManyResponse:
        items = request.claims
        if not items:
            raise InvalidArgument("claims is empty; send 1 to 1000 items")
        if len(items) > MAX_CLAIM_MANY_ITEMS:
            raise InvalidArgument(
                f"claims has {len(items)} items; at most {MAX_CLAIM_MANY_ITEMS} are allowed,"
                " send the rest in another call"
            )
        annotate(wake_ids=[item.wake_id for item in items])
        # Every item is checked before anything is written.
        requests = []
        for i, item in enumerate(items):
            agent_id = validate_id(f"claims[{i}].agent_id", item.agent_id)
            wake_id = validate_id(f"claims[{i}].wake_id", item.wake_id)
            if item.claimant:
                validate_id(f"claims[{i}].claimant", item.claimant)
            requests.append((agent_id, wake_id, item.claimant))
        answers = await self._store.claim_many(requests)
        return claims_pb2.ClaimManyResponse(
            answers=[
                claims_pb2.ClaimOnceResponse(claimed=a.claimed, claimed_at=_timestamp(a.claimed_at)) for a in answers
            ]
        )

    async def GetClaim(
        self, request: claims_pb2.GetClaimRequest, context: grpc.aio.ServicerContext
    ) -> claims_pb2.GetClaimResponse:
        agent_id, wake_id = _ids(request.agent_id, request.wake_id)
        claim = await self._store.get_claim(agent_id, wake_id)
        if claim is None:
            raise NotFound(f"no claim for agent_id {agent_id!r} and wake_id {wake_id!r}")
        return claims_pb2.GetClaimResponse(
            agent_id=claim.agent_id, wake_id=claim.wake_id, claimed_at=_timestamp(claim.claimed_at)
        )


def _ids(agent_id: str, wake_id: str) -> tuple[str, str]:
    return validate_id("agent_id", agent_id), validate_id("wake_id", wake_id)


def validate_id(field: str, value: str) -> str:
    """An id is 1 to 200 bytes of UTF-8 without NUL (PostgreSQL text cannot hold NUL)."""
    if not value:
        raise InvalidArgument(f"{field} is required")
    size = len(value.encode("utf-8"))
    if size > MAX_ID_BYTES:
        raise InvalidArgument(f"{field} is {size} bytes; at most {MAX_ID_BYTES} bytes of UTF-8 are allowed")
    if "\x00" in value:
        raise InvalidArgument(f"{field} must not contain a NUL character")
    return value


def _timestamp(dt: datetime) -> Timestamp:
    ts = Timestamp()
    ts.FromDatetime(dt)
    return ts
