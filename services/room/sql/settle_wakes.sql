-- SettleWakes: many leases settled in one statement (services.room.store.RoomStore.settle_wakes).
-- Kept beside queries.sql so the batch has its own file; the rules are those of settle_wake_delivered
-- and settle_wake_retry in queries.sql.

-- name: settle_wakes
-- $1 wake ids, $2 lease owners, $3 delivered (true) or retry (false), $4 retry_after_ms, $5 last errors:
-- one element per item, in the same order. Settles each item whose wake is leased by its owner and not
-- delivered. Answers every item, in order: settled_at when this statement settled it, otherwise the
-- wake's state before the statement (no row when the wake is unknown).
WITH item AS (
    SELECT *
    FROM unnest($1::uuid[], $2::text[], $3::boolean[], $4::bigint[], $5::text[])
        WITH ORDINALITY AS i (wake_id, lease_owner, delivered, retry_after_ms, last_error, n)
), settled AS (
    UPDATE wake_outbox w
    SET delivered_at = CASE WHEN i.delivered THEN now() END,
        due_at = CASE WHEN i.delivered THEN w.due_at ELSE now() + i.retry_after_ms * interval '1 millisecond' END,
        lease_owner = CASE WHEN i.delivered THEN w.lease_owner END,
        lease_expires_at = NULL,
        last_error = CASE WHEN i.delivered THEN NULL ELSE i.last_error END
    FROM item i
    WHERE w.wake_id = i.wake_id AND w.lease_owner = i.lease_owner AND w.delivered_at IS NULL
    RETURNING w.wake_id, now() AS settled_at
)
SELECT i.n, i.wake_id, i.lease_owner, i.delivered, s.settled_at,
    w.wake_id IS NOT NULL AS known, w.lease_owner AS held_by, w.delivered_at
FROM item i
LEFT JOIN settled s ON s.wake_id = i.wake_id
LEFT JOIN wake_outbox w ON w.wake_id = i.wake_id
ORDER BY i.n;
