"""Rules of the run ledger shared by the Runtime (which writes it) and the Room (which ends abandoned runs
and records the runs that never started)."""

from __future__ import annotations

import uuid

from quayutec.v1 import common_pb2

# Run ids are derived from (agent, wake): every delivery of a wake names the same ledger row.
RUN_NAMESPACE = uuid.UUID("6f1c8a52-3d0e-4c1b-9a57-0d3c2f1e9b41")

# Outcomes of declared actions that were not carried out (yet); a run that ends leaves none of them.
UNFINISHED_ACTIONS = (
    common_pb2.ACTION_OUTCOME_UNSPECIFIED,
    common_pb2.ACTION_OUTCOME_PENDING,
    common_pb2.ACTION_OUTCOME_HELD,
)


def mark_undone(run: common_pb2.Run, detail: str) -> None:
    """Mark every unfinished action of ``run`` NOT_DONE, saying why."""
    for action in run.actions:
        if action.outcome in UNFINISHED_ACTIONS:
            action.outcome = common_pb2.ACTION_OUTCOME_NOT_DONE
            action.detail = detail


def run_id_for(agent_id: str, wake_id: str) -> str:
    """The id of the run of ``agent_id`` woken by ``wake_id`` (the same for every delivery of the wake)."""
    return str(uuid.uuid5(RUN_NAMESPACE, f"{agent_id}\x00{wake_id}"))


def continuation_attempt(waitpoint_token: str, claimant: str) -> str:
    """The ledger attempt of a parked run's continuation: the Room lets only such an attempt, of the
    run's decided waitpoint, take a PARKED row over (its fence)."""
    return f"continue:{waitpoint_token}:{claimant}"
