"""Rules of the run ledger shared by the Runtime (which writes it) and the Room (which ends abandoned runs)."""

from __future__ import annotations

from quayutec.v1 import common_pb2

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
