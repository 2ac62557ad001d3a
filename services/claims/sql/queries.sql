-- Queries of the Claims service. No query updates or deletes agent_run_locks: a claim is forever.

-- name: claim_once
-- Claims one pair for claimant $3; returns a row only for the call that made the claim.
INSERT INTO agent_run_locks (agent_id, wake_id, claimant)
VALUES ($1, $2, $3)
ON CONFLICT DO NOTHING
RETURNING claimed_at;

-- name: claim_many
-- Claims distinct pairs in one statement; returns the pairs this statement claimed. Rows go in
-- key order so that concurrent batches take row locks in one order and never deadlock.
INSERT INTO agent_run_locks (agent_id, wake_id, claimant)
SELECT agent_id, wake_id, claimant
FROM unnest($1::text[], $2::text[], $3::text[]) AS pair (agent_id, wake_id, claimant)
ORDER BY agent_id, wake_id
ON CONFLICT DO NOTHING
RETURNING agent_id, wake_id, claimed_at;

-- name: get_claim
SELECT claimed_at, claimant
FROM agent_run_locks
WHERE agent_id = $1 AND wake_id = $2;

-- name: get_claims
-- Reads the existing claims of many pairs (those a batch found already claimed).
SELECT l.agent_id, l.wake_id, l.claimed_at, l.claimant
FROM agent_run_locks AS l
JOIN unnest($1::text[], $2::text[]) AS pair (agent_id, wake_id)
  ON l.agent_id = pair.agent_id AND l.wake_id = pair.wake_id;
