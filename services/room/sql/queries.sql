-- All SQL of the Room service, loaded once by services.room.store (quayutec.sql.Queries).
-- Keyset pages: every list query takes the last key of the previous page and a row limit.

-- name: create_company
INSERT INTO companies (name) VALUES ($1)
RETURNING company_id, name, created_at;

-- name: get_company
SELECT company_id, name, created_at FROM companies WHERE company_id = $1;

-- name: company_exists
SELECT EXISTS (SELECT 1 FROM companies WHERE company_id = $1);

-- name: create_room
-- The room and its first member (the creating company) in one statement; no row when the company is
-- unknown, or when its dedupe key $3 is taken (a concurrent create committed first).
WITH room AS (
    INSERT INTO rooms (name, created_by_company_id, dedupe_key)
    SELECT $2, company_id, $3 FROM companies WHERE company_id = $1
    ON CONFLICT (created_by_company_id, dedupe_key) DO NOTHING
    RETURNING room_id, name, created_by_company_id, created_at, archived_at
), member AS (
    INSERT INTO room_members (room_id, company_id)
    SELECT room_id, created_by_company_id FROM room
)
SELECT room_id, name, created_by_company_id, created_at, archived_at FROM room;

-- name: find_room_by_dedupe
SELECT room_id, name, created_by_company_id, created_at, archived_at FROM rooms
WHERE created_by_company_id = $1 AND dedupe_key = $2;

-- name: get_room
SELECT room_id, name, created_by_company_id, created_at, archived_at FROM rooms WHERE room_id = $1;

-- name: find_room_by_name
-- The room company $1 created named $2 as the unique index rooms_creator_name compares names.
SELECT room_id, name FROM rooms WHERE created_by_company_id = $1 AND lower(name) = lower($2);

-- name: room_archived
SELECT archived_at IS NOT NULL FROM rooms WHERE room_id = $1;

-- name: rename_room
-- Room $1 named $2 (its row locked by lock_room_for_membership first); a name another room of its creator
-- holds fails on rooms_creator_name.
UPDATE rooms SET name = $2 WHERE room_id = $1
RETURNING room_id, name, created_by_company_id, created_at, archived_at;

-- name: archive_room
-- Room $1 archived (once: archiving again keeps the first time) and its pending invitations withdrawn, in
-- one statement (its row locked by lock_room_for_membership first).
WITH room AS (
    UPDATE rooms SET archived_at = COALESCE(archived_at, now()) WHERE room_id = $1
    RETURNING room_id, name, created_by_company_id, created_at, archived_at
), withdrawn AS (
    UPDATE room_invitations SET status = 'withdrawn', responded_at = now()
    WHERE room_id = $1 AND status = 'pending'
)
SELECT * FROM room;

-- name: room_exists
SELECT EXISTS (SELECT 1 FROM rooms WHERE room_id = $1);

-- name: is_member
SELECT EXISTS (SELECT 1 FROM room_members WHERE room_id = $1 AND company_id = $2);

-- name: list_rooms
SELECT r.room_id, r.name, r.created_by_company_id, r.created_at, r.archived_at, m.pos
FROM room_members m
JOIN rooms r ON r.room_id = m.room_id
WHERE m.company_id = $1 AND m.pos > $2
ORDER BY m.pos
LIMIT $3;

-- name: lock_room_for_membership
-- Serializes invitations into one room with each other (CreateInvitation appends no event).
SELECT room_id, created_by_company_id, archived_at IS NOT NULL AS archived FROM rooms WHERE room_id = $1
FOR NO KEY UPDATE;

-- name: lock_membership
-- The company's membership of the room, locked FOR SHARE until the writing transaction ends: a departure
-- (which deletes the row) waits for the write to commit, so no write of a company follows its MEMBER_LEFT
-- event. Lock order, always: membership rows, then the room row (the event cursor, taken last).
SELECT true FROM room_members WHERE room_id = $1 AND company_id = $2 FOR SHARE;

-- name: add_member
-- The accepting company's membership (already there after a concurrent accept: no row).
INSERT INTO room_members (room_id, company_id) VALUES ($1, $2)
ON CONFLICT (room_id, company_id) DO NOTHING;

-- name: delete_member
DELETE FROM room_members WHERE room_id = $1 AND company_id = $2
RETURNING room_id, company_id;

-- name: find_pending_invitation
SELECT invitation_id FROM room_invitations WHERE room_id = $1 AND company_id = $2 AND status = 'pending';

-- name: insert_invitation
-- No row when the company already has a pending invitation to the room (a concurrent invite committed
-- first). The inviter's dedupe key $4 is unique (the inviter's transaction holds the room lock, and
-- find_invitation_by_dedupe ran first).
INSERT INTO room_invitations (room_id, company_id, invited_by_company_id, dedupe_key) VALUES ($1, $2, $3, $4)
ON CONFLICT (room_id, company_id) WHERE status = 'pending' DO NOTHING
RETURNING invitation_id;

-- name: find_invitation_by_dedupe
SELECT invitation_id FROM room_invitations WHERE invited_by_company_id = $1 AND dedupe_key = $2;

-- name: get_invitation
SELECT i.invitation_id, i.room_id, r.name AS room_name, i.company_id, invited.name AS company_name,
    i.invited_by_company_id, c.name AS invited_by_company_name, i.status, i.created_at, i.responded_at, i.pos
FROM room_invitations i
JOIN rooms r ON r.room_id = i.room_id
JOIN companies c ON c.company_id = i.invited_by_company_id
JOIN companies invited ON invited.company_id = i.company_id
WHERE i.invitation_id = $1;

-- name: lock_invitation
SELECT invitation_id, room_id, company_id, invited_by_company_id, status FROM room_invitations
WHERE invitation_id = $1 FOR UPDATE;

-- name: withdraw_invitations_sent_by
-- The pending invitations company $2 sent into room $1, withdrawn as its membership ends: an invitation
-- dies with its sender's membership (an accept waiting on the row's lock then reads it withdrawn).
UPDATE room_invitations SET status = 'withdrawn', responded_at = now()
WHERE room_id = $1 AND invited_by_company_id = $2 AND status = 'pending';

-- name: list_room_invitations
-- The invitations into room $1, by status.
SELECT i.invitation_id, i.room_id, r.name AS room_name, i.company_id, invited.name AS company_name,
    i.invited_by_company_id, c.name AS invited_by_company_name, i.status, i.created_at, i.responded_at, i.pos
FROM room_invitations i
JOIN rooms r ON r.room_id = i.room_id
JOIN companies c ON c.company_id = i.invited_by_company_id
JOIN companies invited ON invited.company_id = i.company_id
WHERE i.room_id = $1 AND i.status = $2 AND i.pos > $3
ORDER BY i.pos
LIMIT $4;

-- name: respond_invitation
UPDATE room_invitations SET status = $2, responded_at = now() WHERE invitation_id = $1 AND status = 'pending';

-- name: list_invitations
SELECT i.invitation_id, i.room_id, r.name AS room_name, i.company_id, invited.name AS company_name,
    i.invited_by_company_id, c.name AS invited_by_company_name, i.status, i.created_at, i.responded_at, i.pos
FROM room_invitations i
JOIN rooms r ON r.room_id = i.room_id
JOIN companies c ON c.company_id = i.invited_by_company_id
JOIN companies invited ON invited.company_id = i.company_id
WHERE i.company_id = $1 AND i.status = $2 AND i.pos > $3
ORDER BY i.pos
LIMIT $4;

-- name: list_sent_invitations
-- The invitations company $1 sent, by status.
SELECT i.invitation_id, i.room_id, r.name AS room_name, i.company_id, invited.name AS company_name,
    i.invited_by_company_id, c.name AS invited_by_company_name, i.status, i.created_at, i.responded_at, i.pos
FROM room_invitations i
JOIN rooms r ON r.room_id = i.room_id
JOIN companies c ON c.company_id = i.invited_by_company_id
JOIN companies invited ON invited.company_id = i.company_id
WHERE i.invited_by_company_id = $1 AND i.status = $2 AND i.pos > $3
ORDER BY i.pos
LIMIT $4;

-- name: expire_waitpoints_of_company_in_room
-- A departed company's pending waitpoints in the room, each with its decision wake (its run ends the
-- held actions undone), in one statement.
WITH expired AS (
    UPDATE waitpoints SET status = 'expired'
    WHERE room_id = $1 AND company_id = $2 AND status = 'pending'
    RETURNING token, agent_id, room_id
), woken AS (
    INSERT INTO wake_outbox (agent_id, room_id, kind, source_id)
    SELECT agent_id, room_id, 'decision', token::text FROM expired
    ON CONFLICT (agent_id, kind, source_id) DO NOTHING
)
SELECT count(*) FROM expired;

-- name: get_member
SELECT room_id, company_id, joined_at FROM room_members WHERE room_id = $1 AND company_id = $2;

-- name: list_members
SELECT m.room_id, m.company_id, c.name AS company_name, m.joined_at, m.pos
FROM room_members m
JOIN companies c ON c.company_id = m.company_id
WHERE m.room_id = $1 AND m.pos > $2
ORDER BY m.pos
LIMIT $3;

-- name: register_agent
WITH company AS (
    SELECT company_id, name FROM companies WHERE company_id = $1
), made AS (
    INSERT INTO agents (company_id, name, provider, model, base_url, provider_key_encrypted, system_prompt, dedupe_key)
    SELECT company_id, $2, $3, $4, $5, $6, $7, $8 FROM company
    ON CONFLICT (company_id, dedupe_key) DO NOTHING
    RETURNING agent_id, company_id, name, provider, model, base_url, system_prompt,
        provider_key_encrypted IS NOT NULL AS has_provider_key, created_at, retired_at
)
SELECT made.*, company.name AS company_name FROM made, company;

-- name: find_agent_by_dedupe
SELECT a.agent_id, a.company_id, c.name AS company_name, a.name, a.provider, a.model, a.base_url,
    a.system_prompt, a.provider_key_encrypted IS NOT NULL AS has_provider_key, a.created_at, a.retired_at
FROM agents a JOIN companies c ON c.company_id = a.company_id
WHERE a.company_id = $1 AND a.dedupe_key = $2;

-- name: find_agent_by_name
-- The agent of company $1 named $2 as the unique index agents_company_name compares names.
SELECT agent_id, name FROM agents WHERE company_id = $1 AND lower(name) = lower($2);

-- name: lock_agent
SELECT company_id FROM agents WHERE agent_id = $1 FOR NO KEY UPDATE;

-- name: rename_agent
-- Agent $1 named $2; a name another agent of its company holds fails on agents_company_name.
WITH a AS (
    UPDATE agents SET name = $2 WHERE agent_id = $1
    RETURNING agent_id, company_id, name, provider, model, base_url, system_prompt,
        provider_key_encrypted IS NOT NULL AS has_provider_key, created_at, retired_at
)
SELECT a.*, c.name AS company_name FROM a JOIN companies c ON c.company_id = a.company_id;

-- name: retire_agent
-- Agent $1 retired (once: retiring again keeps the first time), and its wakes not yet delivered and not
-- leased now settled as delivered with a last_error saying why, so no run starts from them.
WITH a AS (
    UPDATE agents SET retired_at = COALESCE(retired_at, now()) WHERE agent_id = $1
    RETURNING agent_id, company_id, name, provider, model, base_url, system_prompt,
        provider_key_encrypted IS NOT NULL AS has_provider_key, created_at, retired_at
), settled AS (
    UPDATE wake_outbox SET delivered_at = now(), lease_expires_at = NULL, last_error = 'its agent was retired'
    WHERE agent_id = $1 AND delivered_at IS NULL AND (lease_expires_at IS NULL OR lease_expires_at < now())
)
SELECT a.*, c.name AS company_name FROM a JOIN companies c ON c.company_id = a.company_id;

-- name: get_agent
SELECT a.agent_id, a.company_id, c.name AS company_name, a.name, a.provider, a.model, a.base_url,
    a.system_prompt, a.provider_key_encrypted IS NOT NULL AS has_provider_key, a.created_at, a.retired_at
FROM agents a JOIN companies c ON c.company_id = a.company_id
WHERE a.agent_id = $1;

-- name: get_agent_credentials
SELECT a.agent_id, a.company_id, c.name AS company_name, a.name, a.provider, a.model, a.base_url,
    a.system_prompt, a.provider_key_encrypted IS NOT NULL AS has_provider_key, a.created_at, a.retired_at,
    a.provider_key_encrypted
FROM agents a JOIN companies c ON c.company_id = a.company_id
WHERE a.agent_id = $1;

-- name: list_agents
SELECT a.agent_id, a.company_id, c.name AS company_name, a.name, a.provider, a.model, a.base_url,
    a.system_prompt, a.provider_key_encrypted IS NOT NULL AS has_provider_key, a.created_at, a.retired_at, a.pos
FROM agents a
JOIN companies c ON c.company_id = a.company_id
WHERE a.company_id = $1 AND a.pos > $2
ORDER BY a.pos
LIMIT $3;

-- name: list_room_agents
-- The agents in room $1: those of its member companies (only company $4's when not NULL), in
-- registration order.
SELECT a.agent_id, a.company_id, c.name AS company_name, a.name, a.provider, a.model, a.base_url,
    a.system_prompt, a.provider_key_encrypted IS NOT NULL AS has_provider_key, a.created_at, a.retired_at, a.pos
FROM agents a
JOIN room_members m ON m.company_id = a.company_id AND m.room_id = $1
JOIN companies c ON c.company_id = a.company_id
WHERE a.pos > $2 AND ($4::uuid IS NULL OR a.company_id = $4)
ORDER BY a.pos
LIMIT $3;

-- name: agents_in_room
-- Each of the given agents with whether its company is a member of room $2.
SELECT a.agent_id, a.company_id,
    EXISTS (SELECT 1 FROM room_members m WHERE m.room_id = $2 AND m.company_id = a.company_id) AS member
FROM agents a
WHERE a.agent_id = ANY ($1::uuid[]);

-- name: agent_company
SELECT company_id FROM agents WHERE agent_id = $1;

-- fragment: post_facts
-- A post's facts as CTEs (author_agent, author_member, mentioned, mentioned_members, earlier; see
-- post_check), with post_check's parameters: $1 room, $2 company, $3 author agent, $4 mentions, $5
-- dedupe key. post_message names them shifted past its own ({{post_facts+21}}).
author_agent AS (
    SELECT company_id FROM agents WHERE agent_id = $3::uuid
), author_member AS (
    SELECT company_id FROM room_members
    WHERE room_id = $1 AND company_id = COALESCE($2::uuid, (SELECT company_id FROM author_agent))
    FOR SHARE
), mentioned AS (
    SELECT agent_id, company_id FROM agents WHERE agent_id = ANY ($4::uuid[])
), mentioned_members AS (
    SELECT company_id FROM room_members
    WHERE room_id = $1 AND company_id IN (SELECT company_id FROM mentioned)
    FOR SHARE
), earlier AS (
    SELECT m FROM messages AS m WHERE m.room_id = $1 AND m.dedupe_key = $5
)

-- fragment: post_fact_columns
-- The facts the rules look at, read from post_facts' CTEs (the same parameters).
EXISTS (SELECT 1 FROM rooms WHERE room_id = $1) AS room_found,
    EXISTS (SELECT 1 FROM rooms WHERE room_id = $1 AND archived_at IS NOT NULL) AS archived,
    (SELECT company_id FROM author_agent) AS agent_company_id,
    (SELECT count(*) FROM author_member) > 0 AS member,
    ARRAY(SELECT agent_id FROM mentioned) AS mentioned_agent_ids,
    ARRAY(SELECT company_id FROM mentioned) AS mentioned_company_ids,
    ARRAY(SELECT company_id FROM mentioned_members) AS member_company_ids,
    (SELECT m FROM earlier) AS earlier

-- name: post_check
-- A post's checks alone, as the Room made them before post_message (the benches' floor and the statements
-- bench run it; the Room itself no longer does), in one statement, taking no lock on the room row: whether room $1 exists; the
-- author agent's company (agent $3, NULL for a person); whether the author's company ($2, or the agent's
-- when NULL) is a member, its membership row locked FOR SHARE (see lock_membership); the mentioned agents
-- $4 that exist with their companies, and which of those companies are members (rows locked FOR SHARE
-- too: a mentioned agent's company cannot leave before the post commits); and the earlier message with
-- dedupe key $5 (a messages row, or NULL) with its wakes.
WITH {{post_facts}}
SELECT {{post_fact_columns}},
    ARRAY(
        SELECT w FROM wake_outbox AS w
        WHERE w.source_id = (SELECT (m).message_id::text FROM earlier) AND w.kind = 'message'
        ORDER BY w.created_at, w.wake_id
    ) AS earlier_wakes;

-- name: insert_message_with_wakes
-- The message ($2: its id) with the room's next seq, and a wake for each agent in $11 (source id $12, the
-- message id as text; $13 the posting span's traceparent; $14 the issuer that verified the person, if any), in one statement. Bumping rooms.last_seq takes the room row's lock (held to
-- commit, so seq order is commit order): the caller runs it last but for its events and COMMIT.
WITH next AS (
    UPDATE rooms SET last_seq = last_seq + 1 WHERE room_id = $1 RETURNING last_seq
), message AS (
    INSERT INTO messages (message_id, room_id, seq, author_kind, author_company_id, author_person,
        author_agent_id, body, mention_agent_ids, run_id, dedupe_key, author_verified_by)
    SELECT $2, $1, next.last_seq, $3, $4, $5, $6, $7, $8::uuid[], $9, $10, $14 FROM next
    RETURNING message_id, room_id, seq, author_kind, author_company_id, author_person, author_agent_id, body,
        mention_agent_ids, run_id, created_at, author_verified_by
), woken AS (
    INSERT INTO wake_outbox AS w (agent_id, room_id, kind, source_id, traceparent)
    SELECT a.agent_id, $1, 'message', $12, $13 FROM message, unnest($11::uuid[]) AS a (agent_id)
    ON CONFLICT (agent_id, kind, source_id) DO NOTHING
    RETURNING w
)
SELECT message.*, ARRAY(SELECT w FROM woken) AS wakes FROM message;

-- fragment: allowed_fenced_run_write
-- The fence as the writes of content use it (post_message, create_task, update_task, write_memory): the
-- ledger row $1..$19 is written when a run is given ($1) and the statement's rules allow the write
-- (its CTE allowed, defined before).
admitted AS (
    SELECT ok AND $1::text IS NOT NULL AS ok FROM allowed
), {{fenced_run_write}}

-- fragment: kept_run_writes
-- The SET items of a ledger row's upsert (ON CONFLICT, the stored row aliased r) that keep what a
-- committed write recorded (docs/durability.md, "What the ledger keeps"): posted_message_id, once set,
-- is never cleared (a write that names no reply leaves it; one that names a reply is the Room's own
-- write of that reply, with its id filled in), and an action recorded ACTION_OUTCOME_DONE stays done
-- with its result id unless the write itself records that action done (the Room's own write of it); a
-- run whose answer was lost, which ends the action not_done, leaves it done. An action only the stored
-- row has is kept. Everything else is the write's. Actions are stored as MessageToDict objects, which
-- leave out index 0.
posted_message_id = COALESCE(NULLIF(EXCLUDED.posted_message_id, ''), r.posted_message_id),
        actions = (
            SELECT COALESCE(jsonb_agg(CASE WHEN incoming.a IS NULL OR (kept.a->>'outcome' = 'ACTION_OUTCOME_DONE'
                AND incoming.a->>'outcome' IS DISTINCT FROM 'ACTION_OUTCOME_DONE') THEN kept.a ELSE incoming.a END
                ORDER BY n), '[]'::jsonb)
            FROM (SELECT a, COALESCE((a->>'index')::int, 0) AS n FROM jsonb_array_elements(EXCLUDED.actions) AS a)
                AS incoming
            FULL JOIN (SELECT a, COALESCE((a->>'index')::int, 0) AS n FROM jsonb_array_elements(r.actions) AS a)
                AS kept USING (n)
        ),

-- fragment: fenced_run_write
-- The ledger row $1..$19 written through the fence, and its room event, as CTEs every statement that
-- writes a run's row shares (named {{fenced_run_write}} in them; the statement defines admitted.ok,
-- whether it may write at all, before it). before: the row as it stood in the statement's snapshot.
-- up: the upsert of upsert_run_with_before, written when the row is new, holds the same attempt ($18), is
-- not_started, or is parked and the write continues its decided waitpoint; an ended row, or one another
-- attempt holds, is left alone (no row). run_event: when the row's status changed into one of $20, the
-- event of kind $21 (the kind of each), for the row's company, carrying the row as written (snapshot).
before AS (
    SELECT r FROM runs AS r WHERE r.run_id = $1
), up AS (
    INSERT INTO runs AS r (run_id, agent_id, company_id, room_id, wake_id, wake_kind, wake_source_id, status, step,
        posted_message_id, actions, model_attempts, error, trace_id, active_ms, started_at, ended_at, attempt,
        trace_ids)
    SELECT $1, $2, COALESCE($3::uuid, (SELECT company_id FROM agents WHERE agent_id = $2)), $4, $5, $6, $7, $8,
        $9, $10, $11::jsonb, $12::jsonb, $13, $14, $15, COALESCE($16::timestamptz, now()), $17, $18, $19::text[]
    FROM admitted WHERE admitted.ok
    ON CONFLICT (run_id) DO UPDATE SET
        agent_id = EXCLUDED.agent_id,
        company_id = EXCLUDED.company_id,
        room_id = EXCLUDED.room_id,
        wake_id = EXCLUDED.wake_id,
        wake_kind = EXCLUDED.wake_kind,
        wake_source_id = EXCLUDED.wake_source_id,
        status = EXCLUDED.status,
        step = EXCLUDED.step,
        {{kept_run_writes}}
        model_attempts = EXCLUDED.model_attempts,
        error = EXCLUDED.error,
        trace_id = COALESCE(NULLIF(r.trace_id, ''), EXCLUDED.trace_id),
        trace_ids = ARRAY(
            SELECT t FROM unnest(r.trace_ids || EXCLUDED.trace_ids) WITH ORDINALITY AS u (t, n)
            GROUP BY t ORDER BY min(n)
        ),
        active_ms = EXCLUDED.active_ms,
        started_at = COALESCE($16::timestamptz, r.started_at),
        updated_at = now(),
        ended_at = EXCLUDED.ended_at,
        attempt = EXCLUDED.attempt
    WHERE r.ended_at IS NULL
        AND (
            r.attempt = EXCLUDED.attempt
            OR r.status = 'not_started'
            OR (r.status = 'parked' AND EXISTS (
                SELECT 1 FROM waitpoints AS w
                WHERE w.run_id = r.run_id AND w.status <> 'pending'
                    AND starts_with(EXCLUDED.attempt, 'continue:' || w.token::text || ':')
            ))
        )
    RETURNING r, r.room_id, r.company_id, r.status
), run_event AS (
    SELECT up.room_id, k.kind, up.company_id AS audience, to_jsonb(up.r) AS snapshot
    FROM up JOIN unnest($20::text[], $21::text[]) AS k (status, kind) ON k.status = up.status
    WHERE up.company_id IS NOT NULL AND up.status IS DISTINCT FROM (SELECT (b.r).status FROM before AS b)

-- name: post_message
-- PostMessage in one statement: the rules' facts, and the post written only when they are those of a new post
-- the rules allow (the store checks that claim against services/room/rules.py, and decides from the facts
-- returned). The facts, as post_check reads them: whether room $22 exists; the author agent's company (agent
-- $24, NULL for a person); whether the author's company ($23, or the agent's when NULL) is a member, its
-- membership row locked FOR SHARE to commit (see lock_membership); the mentioned agents $25 that exist with
-- their companies, and which of those are members (rows locked FOR SHARE too: a mentioned agent's company
-- cannot leave before the post commits); and the earlier message with dedupe key $26 (a messages row, or NULL)
-- with its wakes. Written only when the room exists and is not archived, the author agent exists (of company
-- $23 when given), its company is a member, every mentioned agent's company is a member and no message holds
-- the dedupe key: then the ledger row $1..$19 when given, through the fence with its event (as record_run; the
-- fence refusing it writes nothing else either), then the message $27 with the room's next seq (its UPDATE of
-- the room row refusing an archived one), a wake for each agent in $32 that is not retired, in $32's order
-- (source id $33, traceparent $34) and the events (the run's, when its status changed, then MESSAGE_POSTED
-- carrying the message). With lease owner $36 (NULL: none) the wakes are written leased to it for $37 seconds,
-- attempt 1, as lease_wakes would lease them after the commit (lease_expires_at NULL without an owner);
-- notify_new_wakes sends nothing for leased wakes. The room row's lock (seq and event cursor) is taken by the
-- UPDATE of rooms, which reads the facts and the ledger row first: membership rows, then the ledger row, then
-- the room row, held to commit, so seq order is commit order.
WITH {{post_facts+21}}, facts AS (
    SELECT {{post_fact_columns+21}}
), allowed AS (
    SELECT f.room_found AND NOT f.archived AND f.member AND f.earlier IS NULL
        AND ($24::uuid IS NULL OR f.agent_company_id = COALESCE($23::uuid, f.agent_company_id))
        AND NOT EXISTS (
            SELECT 1 FROM unnest($25::uuid[]) AS x (agent_id)
            WHERE NOT EXISTS (
                SELECT 1 FROM mentioned AS a JOIN mentioned_members AS mm ON mm.company_id = a.company_id
                WHERE a.agent_id = x.agent_id
            )
        ) AS ok
    FROM facts AS f
), {{allowed_fenced_run_write}}
), next AS (
    UPDATE rooms SET last_seq = last_seq + 1, last_event_seq = last_event_seq + 1 + (SELECT count(*) FROM run_event)
    WHERE room_id = $22 AND archived_at IS NULL AND (SELECT ok FROM allowed)
        AND ($1::text IS NULL OR EXISTS (SELECT 1 FROM up))
    RETURNING last_seq, last_event_seq
), message AS (
    INSERT INTO messages AS m (message_id, room_id, seq, author_kind, author_company_id, author_person,
        author_agent_id, body, mention_agent_ids, run_id, dedupe_key, author_verified_by)
    SELECT $27, $22, next.last_seq, $28, COALESCE($23::uuid, (SELECT company_id FROM author_agent)), $29, $24,
        $30, $25::uuid[], $31, $26, $35
    FROM next
    RETURNING m
), woken AS (
    INSERT INTO wake_outbox AS w (agent_id, room_id, kind, source_id, traceparent, lease_owner, lease_expires_at,
        delivery_attempts)
    SELECT a.agent_id, $22, 'message', $33, $34, $36::text, now() + $37::integer * interval '1 second',
        CASE WHEN $36::text IS NULL THEN 0 ELSE 1 END
    FROM message, unnest($32::uuid[]) WITH ORDINALITY AS a (agent_id, n)
    WHERE NOT EXISTS (SELECT 1 FROM agents AS r WHERE r.agent_id = a.agent_id AND r.retired_at IS NOT NULL)
    ORDER BY a.n
    ON CONFLICT (agent_id, kind, source_id) DO NOTHING
    RETURNING w
), appended AS (
    INSERT INTO room_events (room_id, seq, kind, snapshot, audience_company_id)
    SELECT $22, next.last_event_seq - 1, e.kind, e.snapshot, e.audience FROM next, run_event AS e
    UNION ALL
    SELECT $22, next.last_event_seq, 'message_posted', to_jsonb(message.m) - 'dedupe_key', NULL FROM next, message
    RETURNING seq
)
SELECT f.*,
    ARRAY(
        SELECT w FROM wake_outbox AS w
        WHERE w.source_id = (SELECT (m).message_id::text FROM earlier) AND w.kind = 'message'
        ORDER BY w.created_at, w.wake_id
    ) AS earlier_wakes,
    (SELECT m FROM message) AS message, ARRAY(SELECT w FROM woken) AS wakes,
    (SELECT r FROM up) AS run, (SELECT r FROM before) AS stored, (SELECT count(*) FROM appended) AS events
FROM facts AS f;

-- name: list_messages_oldest_first
SELECT message_id, room_id, seq, author_kind, author_company_id, author_person, author_agent_id, body,
    mention_agent_ids, run_id, created_at, author_verified_by
FROM messages
WHERE room_id = $1 AND seq > $2
ORDER BY seq
LIMIT $3;

-- name: get_message
SELECT message_id, room_id, seq, author_kind, author_company_id, author_person, author_agent_id, body,
    mention_agent_ids, run_id, created_at, author_verified_by
FROM messages
WHERE room_id = $1 AND message_id = $2;

-- name: list_messages_newest_first
SELECT message_id, room_id, seq, author_kind, author_company_id, author_person, author_agent_id, body,
    mention_agent_ids, run_id, created_at, author_verified_by
FROM messages
WHERE room_id = $1 AND seq < $2
ORDER BY seq DESC
LIMIT $3;

-- name: insert_wakes
-- $5: the traceparent of the span whose transaction creates them ('' when not traced).
INSERT INTO wake_outbox (agent_id, room_id, kind, source_id, traceparent)
SELECT agent_id, $2, $3, $4, $5 FROM unnest($1::uuid[]) AS a (agent_id)
ON CONFLICT (agent_id, kind, source_id) DO NOTHING
RETURNING wake_id, agent_id, room_id, kind, source_id, delivery_attempts, created_at, traceparent;

-- name: create_task
-- CreateTask in one statement, as post_message: the rules' facts (whether room $22 exists; the author
-- agent's company, agent $24, NULL for a person; whether the author's company, $23 or the agent's, is a
-- member, its membership row locked FOR SHARE to commit; assignee $25 with its company, and whether that
-- company is a member, its row locked FOR SHARE too, so no task follows its MEMBER_LEFT event; the earlier
-- task with dedupe key $26, a tasks row or NULL, with its wakes), and the writes only when the room exists,
-- the author agent exists (of company $23 when given), its company is a member, the assignee exists and its
-- company is a member and no task holds the dedupe key: the ledger row $1..$19 when given, through the
-- fence with its event (as record_run; the fence refusing it writes nothing else either), then task $27
-- ($28 author kind, $29 person, $30 title, $31 body, $32 run id, $35 the issuer that verified the person),
-- a wake for each agent in $33 (traceparent $34) and the events (the run's, when its status changed, then
-- TASK_CREATED carrying the task). The room row's lock (the event cursor) is taken last, by the UPDATE of
-- rooms, which reads the facts and the ledger row first.
WITH author_agent AS (
    SELECT company_id FROM agents WHERE agent_id = $24::uuid
), author_member AS (
    SELECT company_id FROM room_members
    WHERE room_id = $22 AND company_id = COALESCE($23::uuid, (SELECT company_id FROM author_agent))
    FOR SHARE
), assignee AS (
    SELECT agent_id, company_id FROM agents WHERE agent_id = $25::uuid
), assignee_member AS (
    SELECT company_id FROM room_members
    WHERE room_id = $22 AND company_id = (SELECT company_id FROM assignee)
    FOR SHARE
), earlier AS (
    SELECT t FROM tasks AS t WHERE t.room_id = $22 AND t.dedupe_key = $26
), facts AS (
    SELECT EXISTS (SELECT 1 FROM rooms WHERE room_id = $22) AS room_found,
        EXISTS (SELECT 1 FROM rooms WHERE room_id = $22 AND archived_at IS NOT NULL) AS archived,
        (SELECT company_id FROM author_agent) AS agent_company_id,
        (SELECT count(*) FROM author_member) > 0 AS member,
        (SELECT count(*) FROM assignee_member) > 0 AS assignee_in_room,
        (SELECT t FROM earlier) AS earlier
), allowed AS (
    SELECT f.room_found AND NOT f.archived AND f.member AND f.assignee_in_room AND f.earlier IS NULL
        AND ($24::uuid IS NULL OR f.agent_company_id = COALESCE($23::uuid, f.agent_company_id)) AS ok
    FROM facts AS f
), {{allowed_fenced_run_write}}
), next AS (
    UPDATE rooms SET last_event_seq = last_event_seq + 1 + (SELECT count(*) FROM run_event)
    WHERE room_id = $22 AND archived_at IS NULL AND (SELECT ok FROM allowed)
        AND ($1::text IS NULL OR EXISTS (SELECT 1 FROM up))
    RETURNING last_event_seq
), task AS (
    INSERT INTO tasks AS t (task_id, room_id, from_kind, from_company_id, from_person, from_agent_id, to_agent_id,
        title, body, run_id, dedupe_key, from_verified_by)
    SELECT $27, $22, $28, COALESCE($23::uuid, (SELECT company_id FROM author_agent)), $29, $24, $25, $30, $31, $32,
        $26, $35
    FROM next
    RETURNING t
), woken AS (
    INSERT INTO wake_outbox AS w (agent_id, room_id, kind, source_id, traceparent)
    SELECT a.agent_id, $22, 'task', (task.t).task_id::text, $34 FROM task, unnest($33::uuid[]) AS a (agent_id)
    WHERE NOT EXISTS (SELECT 1 FROM agents AS r WHERE r.agent_id = a.agent_id AND r.retired_at IS NOT NULL)
    ON CONFLICT (agent_id, kind, source_id) DO NOTHING
    RETURNING w
), appended AS (
    INSERT INTO room_events (room_id, seq, kind, snapshot, audience_company_id)
    SELECT $22, next.last_event_seq - 1, e.kind, e.snapshot, e.audience FROM next, run_event AS e
    UNION ALL
    SELECT $22, next.last_event_seq, 'task_created', to_jsonb(task.t) - 'dedupe_key', NULL FROM next, task
    RETURNING seq
)
SELECT f.*,
    ARRAY(
        SELECT w FROM wake_outbox AS w
        WHERE w.source_id = (SELECT (t).task_id::text FROM earlier) AND w.kind = 'task'
        ORDER BY w.created_at, w.wake_id
    ) AS earlier_wakes,
    (SELECT t FROM task) AS task, ARRAY(SELECT w FROM woken) AS wakes,
    (SELECT r FROM up) AS run, (SELECT r FROM before) AS stored, (SELECT count(*) FROM appended) AS events
FROM facts AS f;

-- name: get_task
SELECT task_id, room_id, from_kind, from_company_id, from_person, from_agent_id, to_agent_id, title, body,
    status, run_id, created_at, updated_at, pos, from_verified_by
FROM tasks WHERE task_id = $1;

-- name: update_task
-- UpdateTask in one statement, as create_task: the rules' facts (task $22 locked FOR NO KEY UPDATE, so the
-- updates of one task are serialized, with its assignee's company; the author agent's company, agent $24,
-- NULL for a person; whether the author's company, $23 or the agent's, is a member of the task's room, its
-- membership row locked FOR SHARE to commit; the earlier update with dedupe key $26, a task_updates row or
-- NULL), and the writes only when the task exists (in room $25 when given), the ledger row is of its room,
-- the author agent exists (of company $23 when given), its company is a member and the task's sender's or
-- its assignee's company, the task is open and no update holds the dedupe key: the ledger row $1..$19 when
-- given, through the fence with its event (as record_run; the fence refusing it writes nothing else
-- either), then update $27 ($28 author kind, $29 person, $30 note, $31 the task's status after it, $32 run
-- id), the task's status, and the events (the run's, when its status changed, then TASK_UPDATED, or
-- TASK_CLOSED when $31 is not 'open', carrying the task with all its updates, the new one last). Lock
-- order: the task row, the membership row, the ledger row, then the room row (the event cursor) last, by
-- the UPDATE of rooms. The task's other facts are read in the statement's snapshot, taken before it
-- waited for the task's lock: stale says an update committed in between (the task row locked is not the
-- one the snapshot holds); then nothing is written, and the caller sends it again after lock_task.
WITH task AS (
    SELECT t, t.xmin AS version FROM tasks AS t WHERE t.task_id = $22 FOR NO KEY UPDATE OF t
), author_agent AS (
    SELECT company_id FROM agents WHERE agent_id = $24::uuid
), author_member AS (
    SELECT company_id FROM room_members
    WHERE room_id = (SELECT (t).room_id FROM task)
        AND company_id = COALESCE($23::uuid, (SELECT company_id FROM author_agent))
    FOR SHARE
), earlier AS (
    SELECT u FROM task_updates AS u WHERE u.task_id = $22 AND u.dedupe_key = $26
), facts AS (
    SELECT (SELECT t FROM task) AS task,
        (SELECT version FROM task) IS DISTINCT FROM (SELECT xmin FROM tasks WHERE task_id = $22) AS stale,
        EXISTS (
            SELECT 1 FROM rooms WHERE room_id = (SELECT (t).room_id FROM task) AND archived_at IS NOT NULL
        ) AS archived,
        (SELECT a.company_id FROM agents AS a WHERE a.agent_id = (SELECT (t).to_agent_id FROM task))
            AS assignee_company_id,
        (SELECT company_id FROM author_agent) AS agent_company_id,
        (SELECT count(*) FROM author_member) > 0 AS member,
        (SELECT u FROM earlier) AS earlier
), allowed AS (
    SELECT (f.task).task_id IS NOT NULL AND NOT f.stale AND NOT f.archived AND f.member AND f.earlier IS NULL
        AND ($25::uuid IS NULL OR (f.task).room_id = $25)
        AND ($1::text IS NULL OR (f.task).room_id = $4::uuid)
        AND ($24::uuid IS NULL OR f.agent_company_id = COALESCE($23::uuid, f.agent_company_id))
        AND COALESCE($23::uuid, f.agent_company_id) IN ((f.task).from_company_id, f.assignee_company_id)
        AND (f.task).status = 'open' AS ok
    FROM facts AS f
), {{allowed_fenced_run_write}}
), next AS (
    UPDATE rooms SET last_event_seq = last_event_seq + 1 + (SELECT count(*) FROM run_event)
    WHERE room_id = (SELECT (t).room_id FROM task) AND archived_at IS NULL AND (SELECT ok FROM allowed)
        AND ($1::text IS NULL OR EXISTS (SELECT 1 FROM up))
    RETURNING room_id, last_event_seq
), added AS (
    INSERT INTO task_updates AS u (update_id, task_id, author_kind, author_company_id, author_person, author_agent_id,
        note, status, run_id, dedupe_key)
    SELECT $27, $22, $28, COALESCE($23::uuid, (SELECT company_id FROM author_agent)), $29, $24, $30, $31, $32, $26
    FROM next
    RETURNING u
), written AS (
    UPDATE tasks AS t SET status = $31, updated_at = now()
    FROM next
    WHERE t.task_id = $22
    RETURNING t
), updates AS (
    SELECT u FROM task_updates AS u WHERE u.task_id = $22
    UNION ALL
    SELECT u FROM added
), appended AS (
    INSERT INTO room_events (room_id, seq, kind, snapshot, audience_company_id)
    SELECT next.room_id, next.last_event_seq - 1, e.kind, e.snapshot, e.audience FROM next, run_event AS e
    UNION ALL
    SELECT next.room_id, next.last_event_seq, CASE WHEN $31 = 'open' THEN 'task_updated' ELSE 'task_closed' END,
        (to_jsonb(written.t) - 'dedupe_key') || jsonb_build_object(
            'updates', (SELECT jsonb_agg(to_jsonb(u) - 'dedupe_key' ORDER BY (u).pos) FROM updates)
        ),
        NULL
    FROM next, written
    RETURNING seq
)
SELECT f.*, (SELECT t FROM written) AS written, (SELECT u FROM added) AS added,
    ARRAY(SELECT u FROM updates ORDER BY (u).pos) AS updates,
    (SELECT r FROM up) AS run, (SELECT r FROM before) AS stored, (SELECT count(*) FROM appended) AS events
FROM facts AS f;

-- name: lock_task
-- Task $1 locked to the end of the transaction (FOR NO KEY UPDATE, as update_task locks it): an update_task
-- sent after it in the transaction reads the task's updates in a snapshot taken with the lock held.
SELECT true FROM tasks WHERE task_id = $1 FOR NO KEY UPDATE;

-- name: list_tasks
SELECT task_id, room_id, from_kind, from_company_id, from_person, from_agent_id, to_agent_id, title, body,
    status, run_id, created_at, updated_at, pos, from_verified_by
FROM tasks
WHERE room_id = $1 AND ($2::uuid IS NULL OR to_agent_id = $2) AND ($3::text IS NULL OR status = $3) AND pos > $4
ORDER BY pos
LIMIT $5;

-- name: updates_of_tasks
SELECT update_id, task_id, author_kind, author_company_id, author_person, author_agent_id, note, status, run_id,
    created_at
FROM task_updates
WHERE task_id = ANY ($1::uuid[])
ORDER BY pos;

-- name: write_memory
-- WriteMemory in one statement, as post_message: the rules' facts (whether room $22 exists; the author
-- agent's company, agent $24, NULL for a person; whether the author's company, $23 or the agent's, is a
-- member, its membership row locked FOR SHARE to commit; the earlier line with dedupe key $25, as a
-- room_context_memory, or NULL), and the writes only when the room exists, the author agent exists (of
-- company $23 when given), its company is a member and no line holds the dedupe key: the ledger row
-- $1..$19 when given, through the fence with its event (as record_run; the fence refusing it writes
-- nothing else either), then line $26 ($27 author kind, $28 person, $29 text, $30 visibility, $31 run id)
-- and the events (the run's, when its status changed, then MEMORY_WRITTEN carrying the line, for the
-- author's company only when the line is private to it). The room row's lock (the event cursor) is taken
-- last, by the UPDATE of rooms, which reads the facts and the ledger row first.
WITH author_agent AS (
    SELECT company_id FROM agents WHERE agent_id = $24::uuid
), author_member AS (
    SELECT company_id FROM room_members
    WHERE room_id = $22 AND company_id = COALESCE($23::uuid, (SELECT company_id FROM author_agent))
    FOR SHARE
), earlier AS (
    SELECT ROW(l.memory_id, l.room_id, l.author_kind, l.author_company_id, l.author_person, l.author_agent_id,
        l.text, l.visibility, l.run_id, l.created_at, l.pos)::room_context_memory AS line
    FROM memory_lines AS l
    WHERE l.room_id = $22 AND l.dedupe_key = $25
), facts AS (
    SELECT EXISTS (SELECT 1 FROM rooms WHERE room_id = $22) AS room_found,
        EXISTS (SELECT 1 FROM rooms WHERE room_id = $22 AND archived_at IS NOT NULL) AS archived,
        (SELECT company_id FROM author_agent) AS agent_company_id,
        (SELECT count(*) FROM author_member) > 0 AS member,
        (SELECT line FROM earlier) AS earlier
), allowed AS (
    SELECT f.room_found AND NOT f.archived AND f.member AND f.earlier IS NULL
        AND ($24::uuid IS NULL OR f.agent_company_id = COALESCE($23::uuid, f.agent_company_id)) AS ok
    FROM facts AS f
), {{allowed_fenced_run_write}}
), next AS (
    UPDATE rooms SET last_event_seq = last_event_seq + 1 + (SELECT count(*) FROM run_event)
    WHERE room_id = $22 AND archived_at IS NULL AND (SELECT ok FROM allowed)
        AND ($1::text IS NULL OR EXISTS (SELECT 1 FROM up))
    RETURNING last_event_seq
), line AS (
    INSERT INTO memory_lines AS l (memory_id, room_id, author_kind, author_company_id, author_person,
        author_agent_id, text, visibility, run_id, dedupe_key)
    SELECT $26, $22, $27, COALESCE($23::uuid, (SELECT company_id FROM author_agent)), $28, $24, $29, $30, $31, $25
    FROM next
    RETURNING l.memory_id, l.room_id, l.author_kind, l.author_company_id, l.author_person, l.author_agent_id,
        l.text, l.visibility, l.run_id, l.created_at, l.pos
), appended AS (
    INSERT INTO room_events (room_id, seq, kind, snapshot, audience_company_id)
    SELECT $22, next.last_event_seq - 1, e.kind, e.snapshot, e.audience FROM next, run_event AS e
    UNION ALL
    SELECT $22, next.last_event_seq, 'memory_written', to_jsonb(line),
        CASE WHEN line.visibility = 'company' THEN line.author_company_id END
    FROM next, line
    RETURNING seq
)
SELECT f.*, (SELECT ROW(line.*)::room_context_memory FROM line) AS line,
    (SELECT r FROM up) AS run, (SELECT r FROM before) AS stored, (SELECT count(*) FROM appended) AS events
FROM facts AS f;

-- name: list_memory
-- Newest first; lines private to another company are never selected.
SELECT memory_id, room_id, author_kind, author_company_id, author_person, author_agent_id, text, visibility,
    run_id, created_at, pos
FROM memory_lines
WHERE room_id = $1 AND (visibility = 'room' OR author_company_id = $2) AND pos < $3
ORDER BY pos DESC
LIMIT $4;

-- name: search_memory
SELECT memory_id, room_id, author_kind, author_company_id, author_person, author_agent_id, text, visibility,
    run_id, created_at, pos
FROM memory_lines
WHERE room_id = $1 AND (visibility = 'room' OR author_company_id = $2) AND pos < $3
    AND tsv @@ websearch_to_tsquery('english', $5)
ORDER BY pos DESC
LIMIT $4;

-- name: insert_file
INSERT INTO files (room_id, author_kind, author_company_id, author_person, author_agent_id, name, content_type,
    content, size_bytes, passage_count)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)
RETURNING file_id, room_id, author_kind, author_company_id, author_person, author_agent_id, name, content_type,
    size_bytes, passage_count, created_at, pos;

-- name: insert_passages
INSERT INTO passages (file_id, room_id, ordinal, text)
SELECT $1, $2, p.ordinal, p.text FROM unnest($3::integer[], $4::text[]) AS p (ordinal, text);

-- name: list_files
SELECT file_id, room_id, author_kind, author_company_id, author_person, author_agent_id, name, content_type,
    size_bytes, passage_count, created_at, pos
FROM files
WHERE room_id = $1 AND pos > $2
ORDER BY pos
LIMIT $3;

-- name: search_passages_all_terms
-- websearch syntax ("phrases", or, -not); every term must match.
SELECT p.passage_id, p.file_id, f.name AS file_name, p.ordinal, p.text, ts_rank(p.tsv, q.query) AS rank
FROM passages p
JOIN files f ON f.file_id = p.file_id
CROSS JOIN websearch_to_tsquery('english', $2) AS q (query)
WHERE p.room_id = $1 AND p.tsv @@ q.query
ORDER BY rank DESC, f.pos, p.ordinal
LIMIT $3;

-- name: search_passages_any_term
-- The fallback for long natural-language queries (a wake's message): any term matches, more is better.
SELECT p.passage_id, p.file_id, f.name AS file_name, p.ordinal, p.text, ts_rank(p.tsv, q.query) AS rank
FROM passages p
JOIN files f ON f.file_id = p.file_id
CROSS JOIN LATERAL (SELECT replace(plainto_tsquery('english', $2)::text, ' & ', ' | ')::tsquery) AS q (query)
WHERE p.room_id = $1 AND p.tsv @@ q.query
ORDER BY rank DESC, f.pos, p.ordinal
LIMIT $3;

-- name: stale_running_runs
-- RUNNING rows untouched for $1 seconds, and PARKED rows whose waitpoint was completed or expired
-- $1 seconds ago yet which never continued (their continuation died before recording RUNNING);
-- oldest first, each locked so one sweeper ends it. Seconds since the last progress in idle_seconds.
SELECT run_id, agent_id, company_id, room_id, wake_id, wake_kind, wake_source_id, status, step,
    posted_message_id, actions, model_attempts, error, trace_id, active_ms, started_at, updated_at, ended_at,
    pos, attempt, trace_ids,
    floor(extract(epoch FROM now() - last_progress))::bigint AS idle_seconds
FROM (
    SELECT r.*, r.updated_at AS last_progress
    FROM runs AS r
    WHERE r.status = 'running' AND r.ended_at IS NULL
    UNION ALL
    SELECT r.*, CASE
        WHEN w.status = 'completed' THEN (SELECT max(h.decided_at) FROM held_actions AS h WHERE h.token = w.token)
        ELSE w.expires_at
    END AS last_progress
    FROM runs AS r
    JOIN waitpoints AS w ON w.run_id = r.run_id
    WHERE r.status = 'parked' AND r.ended_at IS NULL AND w.status <> 'pending'
) AS candidate
WHERE last_progress < now() - $1::bigint * interval '1 second'
ORDER BY last_progress
LIMIT $2;

-- name: lock_unchanged_run
-- Locks one row not ended and unchanged since it was read ($2: its updated_at then); no row when it
-- has moved on or another sweeper holds it.
SELECT run_id, agent_id, company_id, room_id, wake_id, wake_kind, wake_source_id, status, step,
    posted_message_id, actions, model_attempts, error, trace_id, active_ms, started_at, updated_at, ended_at,
    pos, attempt, trace_ids
FROM runs
WHERE run_id = $1 AND ended_at IS NULL AND updated_at = $2
FOR UPDATE SKIP LOCKED;

-- name: unchecked_undelivered_wakes
-- Wakes of messages and tasks created $1 seconds ago or more, delivered at least once, still pending,
-- whose run's ledger row housekeeping has not looked for yet; oldest first, at most $2.
SELECT wake_id, agent_id, room_id, kind, source_id, delivery_attempts, last_error
FROM wake_outbox
WHERE delivered_at IS NULL AND delivery_attempts > 0 AND NOT run_checked AND kind <> 'decision'
    AND created_at < now() - $1::bigint * interval '1 second'
ORDER BY created_at
LIMIT $2;

-- name: insert_not_started_runs
-- A NOT_STARTED row for each run ($1 run ids, $2 wake ids, $3 errors) that has no row yet; the wake's
-- agent, room and source from the outbox. Returns the rows written (none where a row exists).
INSERT INTO runs (run_id, agent_id, company_id, room_id, wake_id, wake_kind, wake_source_id, status, step, error)
SELECT item.run_id, w.agent_id, a.company_id, w.room_id, item.wake_id, w.kind, w.source_id, 'not_started',
    'unspecified', item.error
FROM unnest($1::text[], $2::text[], $3::text[]) AS item (run_id, wake_id, error)
JOIN wake_outbox AS w ON w.wake_id = item.wake_id::uuid
JOIN agents AS a ON a.agent_id = w.agent_id
ON CONFLICT (run_id) DO NOTHING
RETURNING run_id, agent_id, company_id, room_id, wake_id, wake_kind, wake_source_id, status, step,
    posted_message_id, actions, model_attempts, error, trace_id, active_ms, started_at, updated_at, ended_at, pos,
    attempt, trace_ids;

-- name: mark_wakes_run_checked
UPDATE wake_outbox SET run_checked = true WHERE wake_id = ANY($1::uuid[]);

-- name: get_run
SELECT run_id, agent_id, company_id, room_id, wake_id, wake_kind, wake_source_id, status, step,
    posted_message_id, actions, model_attempts, error, trace_id, active_ms, started_at, updated_at, ended_at,
    pos, attempt, trace_ids
FROM runs WHERE run_id = $1;

-- name: list_runs_of_agent
-- Filters ($5 room, $6 status, $7..$8 start time) are NULL when not asked for.
SELECT run_id, agent_id, company_id, room_id, wake_id, wake_kind, wake_source_id, status, step,
    posted_message_id, actions, model_attempts, error, trace_id, active_ms, started_at, updated_at, ended_at,
    pos, attempt, trace_ids
FROM runs
WHERE agent_id = $1 AND ($2::uuid IS NULL OR company_id = $2) AND pos < $3
    AND ($5::uuid IS NULL OR room_id = $5) AND ($6::text IS NULL OR status = $6)
    AND ($7::timestamptz IS NULL OR started_at >= $7) AND ($8::timestamptz IS NULL OR started_at < $8)
ORDER BY pos DESC
LIMIT $4;

-- name: list_runs_of_company
-- Filters ($4 room, $5 status, $6..$7 start time) are NULL when not asked for; each has its index
-- (runs_company_room_pos, runs_company_status_pos, runs_company_started).
SELECT run_id, agent_id, company_id, room_id, wake_id, wake_kind, wake_source_id, status, step,
    posted_message_id, actions, model_attempts, error, trace_id, active_ms, started_at, updated_at, ended_at,
    pos, attempt, trace_ids
FROM runs
WHERE company_id = $1 AND pos < $2
    AND ($4::uuid IS NULL OR room_id = $4) AND ($5::text IS NULL OR status = $5)
    AND ($6::timestamptz IS NULL OR started_at >= $6) AND ($7::timestamptz IS NULL OR started_at < $7)
ORDER BY pos DESC
LIMIT $3;

-- name: lease_wakes
UPDATE wake_outbox
SET lease_owner = $1,
    lease_expires_at = now() + $3::integer * interval '1 second',
    delivery_attempts = delivery_attempts + 1
WHERE wake_id IN (
    SELECT wake_id FROM wake_outbox
    WHERE delivered_at IS NULL AND due_at <= now() AND (lease_expires_at IS NULL OR lease_expires_at < now())
    ORDER BY due_at
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)
RETURNING wake_id, agent_id, room_id, kind, source_id, delivery_attempts, created_at, due_at, traceparent;

-- name: settle_wake_delivered
UPDATE wake_outbox SET delivered_at = now(), lease_expires_at = NULL, last_error = NULL
WHERE wake_id = $1 AND lease_owner = $2 AND delivered_at IS NULL
RETURNING delivered_at AS settled_at;

-- name: settle_wake_retry
UPDATE wake_outbox
SET due_at = now() + $3::bigint * interval '1 millisecond', lease_owner = NULL, lease_expires_at = NULL,
    last_error = $4
WHERE wake_id = $1 AND lease_owner = $2 AND delivered_at IS NULL
RETURNING now() AS settled_at;

-- name: get_wake_lease
SELECT lease_owner, delivered_at FROM wake_outbox WHERE wake_id = $1;

-- name: delete_delivered_wakes
-- Delivered before now() - $1 seconds, oldest first, at most $2; rows another cleaner holds are skipped.
DELETE FROM wake_outbox
WHERE wake_id IN (
    SELECT wake_id FROM wake_outbox
    WHERE delivered_at < now() - $1::integer * interval '1 second'
    ORDER BY delivered_at
    LIMIT $2
    FOR UPDATE SKIP LOCKED
);

-- name: count_pending_wakes
SELECT count(*) AS pending,
    COALESCE((extract(epoch FROM now() - min(created_at)) * 1000)::bigint, 0) AS oldest_pending_age_ms
FROM wake_outbox
WHERE delivered_at IS NULL;

-- name: upsert_agent_rights
-- The company's default ($2 NULL) or one agent's rules: each right named in $8 becomes its value ($3..$7;
-- NULL: not set here), the others keep what is stored (NULL on a new row, where the caller passes NULL for
-- them). One statement, so two writers changing different rights never undo each other's.
INSERT INTO agent_rights (company_id, agent_id, remember, create_task, update_task, close_task, cross_company_task)
VALUES ($1, $2, $3, $4, $5, $6, $7)
ON CONFLICT (company_id, agent_id) DO UPDATE SET
    remember = CASE WHEN 'remember' = ANY ($8::text[]) THEN EXCLUDED.remember ELSE agent_rights.remember END,
    create_task = CASE WHEN 'create_task' = ANY ($8::text[])
        THEN EXCLUDED.create_task ELSE agent_rights.create_task END,
    update_task = CASE WHEN 'update_task' = ANY ($8::text[])
        THEN EXCLUDED.update_task ELSE agent_rights.update_task END,
    close_task = CASE WHEN 'close_task' = ANY ($8::text[]) THEN EXCLUDED.close_task ELSE agent_rights.close_task END,
    cross_company_task = CASE WHEN 'cross_company_task' = ANY ($8::text[])
        THEN EXCLUDED.cross_company_task ELSE agent_rights.cross_company_task END,
    updated_at = now()
RETURNING company_id, agent_id, remember, create_task, update_task, close_task, cross_company_task;

-- name: get_agent_rights
-- The company's default ($2 NULL) or one agent's rules, when stored.
SELECT company_id, agent_id, remember, create_task, update_task, close_task, cross_company_task
FROM agent_rights WHERE company_id = $1 AND agent_id IS NOT DISTINCT FROM $2;

-- name: find_waitpoint_of_run
SELECT token, run_id, agent_id, company_id, room_id, status, created_at, expires_at, pos, traceparent
FROM waitpoints WHERE run_id = $1;

-- name: insert_waitpoint
-- No row when the run already has a waitpoint (a concurrent CreateWaitpoint committed first).
INSERT INTO waitpoints (run_id, agent_id, company_id, room_id, expires_at, traceparent)
VALUES ($1, $2, $3, $4, now() + $5::bigint * interval '1 second', $6)
ON CONFLICT (run_id) DO NOTHING
RETURNING token, run_id, agent_id, company_id, room_id, status, created_at, expires_at, pos, traceparent;

-- name: insert_held_actions
INSERT INTO held_actions (token, action_index, kind, arguments_json)
SELECT $1, h.action_index, h.kind, h.arguments_json
FROM unnest($2::integer[], $3::text[], $4::text[]) AS h (action_index, kind, arguments_json);

-- name: park_run
-- Marks an existing, not ended ledger row parked (CreateWaitpoint without a run to write).
UPDATE runs SET status = 'parked', step = 'parked', updated_at = now()
WHERE run_id = $1 AND ended_at IS NULL
RETURNING run_id, agent_id, company_id, room_id, wake_id, wake_kind, wake_source_id, status, step,
    posted_message_id, actions, model_attempts, error, trace_id, active_ms, started_at, updated_at, ended_at,
    pos, attempt, trace_ids;

-- name: get_waitpoint
SELECT token, run_id, agent_id, company_id, room_id, status, created_at, expires_at, pos, traceparent
FROM waitpoints WHERE token = $1;

-- name: lock_waitpoint
-- Serializes decisions on one token, so exactly one of them completes it.
SELECT token, run_id, agent_id, company_id, room_id, status, created_at, expires_at, pos, traceparent,
    expires_at < now() AS past_expiry
FROM waitpoints WHERE token = $1
FOR UPDATE;

-- name: list_waitpoints
SELECT token, run_id, agent_id, company_id, room_id, status, created_at, expires_at, pos, traceparent
FROM waitpoints
WHERE company_id = $1 AND status = $2 AND pos > $3
ORDER BY pos
LIMIT $4;

-- name: held_actions_of
SELECT token, action_index, kind, arguments_json, decision, decided_by, decided_at, decided_by_verified_by
FROM held_actions
WHERE token = ANY ($1::uuid[])
ORDER BY token, action_index;

-- name: decide_held_action
UPDATE held_actions SET decision = $3, decided_by = $4, decided_at = now(), decided_by_verified_by = $5
WHERE token = $1 AND action_index = $2 AND decision = 'pending';

-- name: complete_waitpoint_if_decided
-- Completes the token once no held action is pending; no row while some still is.
UPDATE waitpoints SET status = 'completed'
WHERE token = $1 AND status = 'pending'
    AND NOT EXISTS (SELECT 1 FROM held_actions WHERE token = $1 AND decision = 'pending')
RETURNING token;

-- name: expire_waitpoint
UPDATE waitpoints SET status = 'expired' WHERE token = $1 AND status = 'pending';

-- name: due_waitpoints
-- Pending tokens past their expiry, oldest first, locked for expire_due_waitpoints in the same transaction.
SELECT token, run_id, traceparent FROM waitpoints
WHERE status = 'pending' AND expires_at < now()
ORDER BY expires_at
LIMIT $1
FOR UPDATE SKIP LOCKED;

-- name: expire_due_waitpoints
-- The tokens $1 (locked by due_waitpoints) EXPIRED, each with its decision wake made under the
-- trace context $2 (the expiry's span), in one statement.
WITH expired AS (
    UPDATE waitpoints SET status = 'expired'
    WHERE token = ANY($1::uuid[]) AND status = 'pending'
    RETURNING token, agent_id, room_id
), woken AS (
    INSERT INTO wake_outbox (agent_id, room_id, kind, source_id, traceparent)
    SELECT agent_id, room_id, 'decision', token::text, $2 FROM expired
    ON CONFLICT (agent_id, kind, source_id) DO NOTHING
)
SELECT count(*) FROM expired;

-- name: room_event_bounds
SELECT last_event_seq, events_pruned_through FROM rooms WHERE room_id = $1;

-- name: read_room_events
-- ReadRoomEvents in one statement (one snapshot): room $1's newest cursor (last_event_seq) and the newest
-- one retention removed (events_pruned_through), whether company $3 (NULL: any) is a member, and, when it
-- is and nothing after cursor $2 was removed, up to $4 events after $2, oldest first. No row when the room
-- is unknown; one row with a NULL seq when no event is read. Where $3 may see an event (visible), what
-- changed: its serialized RoomEvent (detail), or the row it carries rebuilt from its snapshot (message for
-- a posted message, run for a ledger row, memory for a memory line, task for a created, updated or closed
-- task, with task_updates, its updates oldest first, which an update's snapshot carries); none of these
-- where it may not.
WITH room AS (
    SELECT r.last_event_seq, r.events_pruned_through,
        $3::uuid IS NULL OR EXISTS (SELECT 1 FROM room_members AS m WHERE m.room_id = $1 AND m.company_id = $3)
            AS member
    FROM rooms AS r
    WHERE r.room_id = $1
)
SELECT room.last_event_seq, room.events_pruned_through, room.member, e.seq, e.kind, e.created_at,
    e.audience_company_id, e.visible,
    CASE WHEN e.visible THEN e.detail END AS detail,
    CASE WHEN e.visible AND e.snapshot IS NOT NULL AND e.kind = 'message_posted'
        THEN jsonb_populate_record(NULL::messages, e.snapshot) END AS message,
    CASE WHEN e.visible AND e.snapshot IS NOT NULL AND starts_with(e.kind, 'run_')
        THEN jsonb_populate_record(NULL::runs, e.snapshot) END AS run,
    CASE WHEN e.visible AND e.snapshot IS NOT NULL AND e.kind = 'memory_written'
        THEN jsonb_populate_record(NULL::room_context_memory, e.snapshot) END AS memory,
    CASE WHEN e.visible AND e.snapshot IS NOT NULL AND e.kind IN ('task_created', 'task_updated', 'task_closed')
        THEN jsonb_populate_record(NULL::tasks, e.snapshot) END AS task,
    CASE WHEN e.visible AND e.snapshot IS NOT NULL AND e.kind IN ('task_updated', 'task_closed') THEN ARRAY(
        SELECT jsonb_populate_record(NULL::task_updates, u.value)
        FROM jsonb_array_elements(e.snapshot -> 'updates') WITH ORDINALITY AS u (value, n)
        ORDER BY u.n
    ) END AS task_updates
FROM room
LEFT JOIN LATERAL (
    SELECT ev.seq, ev.kind, ev.created_at, ev.audience_company_id, ev.detail, ev.snapshot,
        $3::uuid IS NULL OR ev.audience_company_id IS NULL OR ev.audience_company_id = $3 AS visible
    FROM room_events AS ev
    WHERE room.member AND $2 >= room.events_pruned_through AND ev.room_id = $1 AND ev.seq > $2
    ORDER BY ev.seq
    LIMIT $4
) AS e ON true
ORDER BY e.seq;

-- name: prune_room_events
-- Removes up to $2 events older than $1 seconds, and records the newest removed cursor per room.
WITH removed AS (
    DELETE FROM room_events e
    USING (
        SELECT room_id, seq FROM room_events
        WHERE created_at < now() - make_interval(secs => $1)
        ORDER BY created_at
        LIMIT $2
    ) old
    WHERE e.room_id = old.room_id AND e.seq = old.seq
    RETURNING e.room_id, e.seq
), newest AS (
    SELECT room_id, max(seq) AS seq FROM removed GROUP BY room_id
), marked AS (
    UPDATE rooms r SET events_pruned_through = greatest(r.events_pruned_through, newest.seq)
    FROM newest WHERE r.room_id = newest.room_id
    RETURNING 1
)
SELECT count(*) FROM removed;

-- name: upsert_run_with_before
-- The whole ledger row as it now stands, and its status before in status_before (NULL: there was no
-- row). The fence ($18, the writing run's attempt): a row is written when it is new, holds the same
-- attempt, is not_started, or is parked and the write is a continuation of its decided waitpoint
-- (attempt 'continue:<token>:...'); the write then takes the row over. An ended row, or one another
-- attempt holds, is left alone (no row returned). The first trace id stays trace_id, and trace_ids
-- ($19, what the write names) only grows.
WITH before AS (
    SELECT status FROM runs WHERE run_id = $1
), up AS (
    INSERT INTO runs AS r (run_id, agent_id, company_id, room_id, wake_id, wake_kind, wake_source_id, status, step,
        posted_message_id, actions, model_attempts, error, trace_id, active_ms, started_at, ended_at, attempt,
        trace_ids)
    VALUES ($1, $2, COALESCE($3::uuid, (SELECT company_id FROM agents WHERE agent_id = $2)), $4, $5, $6, $7, $8,
        $9, $10, $11::jsonb, $12::jsonb, $13, $14, $15, COALESCE($16::timestamptz, now()), $17, $18, $19::text[])
    ON CONFLICT (run_id) DO UPDATE SET
        agent_id = EXCLUDED.agent_id,
        company_id = EXCLUDED.company_id,
        room_id = EXCLUDED.room_id,
        wake_id = EXCLUDED.wake_id,
        wake_kind = EXCLUDED.wake_kind,
        wake_source_id = EXCLUDED.wake_source_id,
        status = EXCLUDED.status,
        step = EXCLUDED.step,
        {{kept_run_writes}}
        model_attempts = EXCLUDED.model_attempts,
        error = EXCLUDED.error,
        trace_id = COALESCE(NULLIF(r.trace_id, ''), EXCLUDED.trace_id),
        -- Every trace id the row ever had, oldest first, then the write's new ones: none is lost.
        trace_ids = ARRAY(
            SELECT t FROM unnest(r.trace_ids || EXCLUDED.trace_ids) WITH ORDINALITY AS u (t, n)
            GROUP BY t ORDER BY min(n)
        ),
        active_ms = EXCLUDED.active_ms,
        started_at = COALESCE($16::timestamptz, r.started_at),
        updated_at = now(),
        ended_at = EXCLUDED.ended_at,
        attempt = EXCLUDED.attempt
    WHERE r.ended_at IS NULL
        AND (
            r.attempt = EXCLUDED.attempt
            OR r.status = 'not_started'
            OR (r.status = 'parked' AND EXISTS (
                SELECT 1 FROM waitpoints AS w
                WHERE w.run_id = r.run_id AND w.status <> 'pending'
                    AND starts_with(EXCLUDED.attempt, 'continue:' || w.token::text || ':')
            ))
        )
    RETURNING run_id, agent_id, company_id, room_id, wake_id, wake_kind, wake_source_id, status, step,
        posted_message_id, actions, model_attempts, error, trace_id, active_ms, started_at, updated_at, ended_at,
        pos, attempt, trace_ids
)
SELECT up.*, (SELECT status FROM before) AS status_before FROM up;

-- fragment: run_context_view
-- run_context's CTEs (agent, open_tasks, wake, search, all_terms, any_term), with its parameters $1..$10;
-- run_context_with_run names them shifted past its own ({{run_context_view+21}}).
agent AS (
    SELECT a.agent_id, a.company_id, a.name, a.provider, a.model, a.base_url, a.system_prompt,
        a.provider_key_encrypted IS NOT NULL AS has_provider_key, a.created_at, a.provider_key_encrypted,
        (SELECT c.name FROM companies c WHERE c.company_id = a.company_id) AS company_name,
        EXISTS (SELECT 1 FROM room_members m WHERE m.room_id = $2 AND m.company_id = a.company_id) AS member,
        d.remember AS default_remember, d.create_task AS default_create_task,
        d.update_task AS default_update_task, d.close_task AS default_close_task,
        d.cross_company_task AS default_cross_company_task,
        o.remember AS own_remember, o.create_task AS own_create_task, o.update_task AS own_update_task,
        o.close_task AS own_close_task, o.cross_company_task AS own_cross_company_task
    FROM agents a
    LEFT JOIN agent_rights d ON d.company_id = a.company_id AND d.agent_id IS NULL
    LEFT JOIN agent_rights o ON o.company_id = a.company_id AND o.agent_id = a.agent_id
    WHERE a.agent_id = $1
), open_tasks AS (
    SELECT t FROM tasks AS t
    WHERE t.room_id = $2 AND t.to_agent_id = $1 AND t.status = 'open'
    ORDER BY t.pos
    LIMIT $8
), wake AS (
    SELECT body AS text FROM messages WHERE $4::text = 'message' AND room_id = $2 AND message_id = $5::uuid
    UNION ALL
    SELECT title || E'\n' || body FROM tasks WHERE $4::text = 'task' AND room_id = $2 AND task_id = $5::uuid
    LIMIT 1
), search AS (
    -- The wake text cut to $10 bytes, whole characters only; none when it is blank.
    SELECT CASE WHEN octet_length(w.text) <= $10 THEN w.text ELSE (
        SELECT left(w.text, n) FROM generate_series(least(length(w.text), $10), 0, -1) AS n
        WHERE octet_length(left(w.text, n)) <= $10
        LIMIT 1
    ) END AS query
    FROM wake AS w
    WHERE w.text ~ '[^[:space:]]'
), all_terms AS (
    SELECT ROW(p.passage_id, p.file_id, f.name, p.ordinal, p.text, ts_rank(p.tsv, q.query))::room_context_passage
        AS passage
    FROM search
    CROSS JOIN websearch_to_tsquery('english', search.query) AS q (query)
    JOIN passages p ON p.room_id = $2 AND p.tsv @@ q.query
    JOIN files f ON f.file_id = p.file_id
    ORDER BY ts_rank(p.tsv, q.query) DESC, f.pos, p.ordinal
    LIMIT $6
), any_term AS (
    SELECT ROW(p.passage_id, p.file_id, f.name, p.ordinal, p.text, ts_rank(p.tsv, q.query))::room_context_passage
        AS passage
    FROM search
    CROSS JOIN LATERAL (
        SELECT replace(plainto_tsquery('english', search.query)::text, ' & ', ' | ')::tsquery
    ) AS q (query)
    JOIN passages p ON p.room_id = $2 AND p.tsv @@ q.query
    JOIN files f ON f.file_id = p.file_id
    WHERE NOT EXISTS (SELECT 1 FROM all_terms)
    ORDER BY ts_rank(p.tsv, q.query) DESC, f.pos, p.ordinal
    LIMIT $6
)

-- fragment: run_context_columns
-- run_context's columns, read from the CTEs of run_context_view (the same parameters).
agent.*,
    ARRAY(
        SELECT ROW(a.agent_id, a.company_id, a.name, a.provider, a.model, a.base_url, a.system_prompt,
            a.provider_key_encrypted IS NOT NULL, a.created_at)::room_context_agent
        FROM room_members m
        JOIN agents a ON a.company_id = m.company_id
        WHERE m.room_id = $2
        ORDER BY m.pos, a.pos
        LIMIT $7
    ) AS room_agents,
    ARRAY(
        SELECT m FROM messages AS m
        WHERE m.room_id = $2
        ORDER BY m.seq DESC
        LIMIT $3
    ) AS messages,
    ARRAY(SELECT t FROM open_tasks) AS open_tasks,
    ARRAY(
        SELECT u FROM open_tasks AS o
        JOIN task_updates AS u ON u.task_id = (o.t).task_id
        ORDER BY u.pos
    ) AS task_updates,
    ARRAY(
        SELECT ROW(l.memory_id, l.room_id, l.author_kind, l.author_company_id, l.author_person, l.author_agent_id,
            l.text, l.visibility, l.run_id, l.created_at, l.pos)::room_context_memory
        FROM memory_lines AS l
        WHERE l.room_id = $2 AND (l.visibility = 'room' OR l.author_company_id = agent.company_id)
        ORDER BY l.pos DESC
        LIMIT $9
    ) AS memory,
    (SELECT text FROM wake) AS wake_text,
    ARRAY(SELECT passage FROM all_terms UNION ALL SELECT passage FROM any_term) AS passages

-- name: run_context
-- ReadRunContext's whole view of room $2 for agent $1 in one statement (one snapshot): the agent with its
-- key, whether its company is a member, and its company's default and its own rights (default_*, own_*;
-- NULL where not set); then, as arrays, the room's agents (never their keys; by membership then
-- registration, at most $7), the $3 newest messages (newest first), the agent's open tasks (at most $8)
-- with their updates, the memory its company may read (newest first, at most $9), the wake's text ($4: the
-- wake kind, $5: the message or task id, else NULL) and up to $6 passages matching that text cut to $10
-- bytes: every term, or else any term (search_passages_all_terms, search_passages_any_term).
WITH {{run_context_view}}
SELECT {{run_context_columns}}
FROM agent;

-- name: record_run
-- A ledger row written through the fence with its room event, in one statement. The write is
-- upsert_run_with_before's ($1..$19, the same fence, in the fragment fenced_run_write, which
-- run_context_with_run, post_message, write_memory and create_task share), and when the row's status
-- changed into one of $20 (statuses) the event of kind $21 (the kind of each) is appended for the row's
-- company, carrying the row as written (snapshot). The event is appended by the last CTEs, which
-- read the written row: the room row's lock (the event cursor) is taken after the ledger row's, and is
-- held to commit. Returns the row written (run; NULL when the fence refused it), the row as it stood
-- before in this statement's snapshot (stored), and the events appended.
WITH admitted AS (
    SELECT true AS ok
), {{fenced_run_write}}
), next AS (
    UPDATE rooms SET last_event_seq = last_event_seq + 1
    FROM run_event WHERE rooms.room_id = run_event.room_id
    RETURNING rooms.last_event_seq
), appended AS (
    INSERT INTO room_events (room_id, seq, kind, snapshot, audience_company_id)
    SELECT e.room_id, next.last_event_seq, e.kind, e.snapshot, e.audience FROM next, run_event AS e
    RETURNING seq
)
SELECT (SELECT r FROM up) AS run, (SELECT r FROM before) AS stored, (SELECT count(*) FROM appended) AS events;

-- name: run_context_with_run
-- ReadRunContext with the run's ledger row, in one statement: the row written through the fence with its
-- event (as record_run: $1..$21; admitted when agent $22 exists and its company is a member of room $23),
-- then run_context's view of the room ($22..$31 as run_context's $1..$10), returned only when the fence
-- let the row be written: a run the fence refuses reads nothing of the room. Also returns the row written
-- (run), the row before (stored), whether the agent was admitted, and whether it exists (agent_found).
WITH admitted AS (
    SELECT EXISTS (
        SELECT 1 FROM agents AS a
        JOIN room_members AS m ON m.company_id = a.company_id AND m.room_id = $23
        WHERE a.agent_id = $22
    ) AS ok
), {{fenced_run_write}}
), next AS (
    UPDATE rooms SET last_event_seq = last_event_seq + 1
    FROM run_event WHERE rooms.room_id = run_event.room_id
    RETURNING rooms.last_event_seq
), appended AS (
    INSERT INTO room_events (room_id, seq, kind, snapshot, audience_company_id)
    SELECT e.room_id, next.last_event_seq, e.kind, e.snapshot, e.audience FROM next, run_event AS e
    RETURNING seq
), {{run_context_view+21}}, context AS (
    SELECT {{run_context_columns+21}}
    FROM agent
    WHERE EXISTS (SELECT 1 FROM up)
)
SELECT context.*, (SELECT r FROM up) AS run, (SELECT r FROM before) AS stored,
    (SELECT ok FROM admitted) AS admitted, EXISTS (SELECT 1 FROM agents WHERE agent_id = $22) AS agent_found
FROM (SELECT 1) AS one
LEFT JOIN context ON true;

-- name: append_room_events
-- Appends the events $2 (kinds), $3 (serialized RoomEvents), $4 (audiences) to room $1 with its next
-- cursors, in order, in one statement; no row when the room is unknown. Bumping rooms.last_event_seq takes
-- the room row's lock, held to commit, so cursors commit in order: writers run this last, just before
-- COMMIT, and take every other lock (membership rows first) before it.
WITH next AS (
    UPDATE rooms SET last_event_seq = last_event_seq + cardinality($2::text[]) WHERE room_id = $1
    RETURNING last_event_seq
)
INSERT INTO room_events (room_id, seq, kind, detail, audience_company_id)
SELECT $1, next.last_event_seq - cardinality($2::text[]) + e.n, e.kind, e.detail, e.audience
FROM next, unnest($2::text[], $3::bytea[], $4::uuid[]) WITH ORDINALITY AS e (kind, detail, audience, n)
RETURNING seq;
