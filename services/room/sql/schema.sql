-- Room: the shared state of rooms, as the schema now stands (migrations/ builds it step by step).
-- Enumerations are stored as lowercase text names ('open', 'agent', 'message', ...) for readable rows.

CREATE TABLE companies (
    company_id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    name text NOT NULL CONSTRAINT companies_name_key UNIQUE,
    created_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE rooms (
    room_id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    name text NOT NULL,
    created_by_company_id uuid NOT NULL REFERENCES companies (company_id),
    -- The seq of the room's newest message; bumped in the posting transaction.
    last_seq bigint NOT NULL DEFAULT 0,
    created_at timestamptz NOT NULL DEFAULT now(),
    -- The cursor of the room's newest event (room_events.seq); bumped in the changing transaction.
    last_event_seq bigint NOT NULL DEFAULT 0,
    -- The newest cursor removed by retention cleanup: a watcher resuming from an older cursor has lost events.
    events_pruned_through bigint NOT NULL DEFAULT 0,
    -- The creator's idempotency key: a repeat with it answers this room.
    dedupe_key text,
    -- Set when its creator archived it: read-only from then on (NULL: open).
    archived_at timestamptz
);
CREATE UNIQUE INDEX rooms_company_dedupe_key ON rooms (created_by_company_id, dedupe_key);
-- A room's name is unique among the rooms its creator created, compared as the CLI resolves names
-- (stored trimmed, case ignored).
CREATE UNIQUE INDEX rooms_creator_name ON rooms (created_by_company_id, lower(name));

CREATE TABLE room_members (
    room_id uuid NOT NULL REFERENCES rooms (room_id),
    company_id uuid NOT NULL REFERENCES companies (company_id),
    pos bigint GENERATED ALWAYS AS IDENTITY,
    joined_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (room_id, company_id)
);
CREATE INDEX room_members_room_pos ON room_members (room_id, pos);
CREATE INDEX room_members_company_pos ON room_members (company_id, pos);

-- An invitation of a company into a room: membership is by consent, so the invited company becomes
-- a member (a room_members row) only when it accepts. Leaving deletes the membership, not this row.
CREATE TABLE room_invitations (
    invitation_id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    room_id uuid NOT NULL REFERENCES rooms (room_id),
    -- The invited company: the only one that sees, accepts or declines the invitation.
    company_id uuid NOT NULL REFERENCES companies (company_id),
    invited_by_company_id uuid NOT NULL REFERENCES companies (company_id),
    pos bigint GENERATED ALWAYS AS IDENTITY,
    -- withdrawn: by the room's creator or its sender, or when its sender's company left the room.
    status text NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'accepted', 'declined', 'withdrawn')),
    created_at timestamptz NOT NULL DEFAULT now(),
    responded_at timestamptz,
    CONSTRAINT room_invitations_responded_check CHECK ((status = 'pending') = (responded_at IS NULL)),
    -- The inviter's idempotency key: a repeat with it answers this invitation.
    dedupe_key text
);
CREATE UNIQUE INDEX room_invitations_inviter_dedupe_key ON room_invitations (invited_by_company_id, dedupe_key);
-- At most one pending invitation of a company into a room.
CREATE UNIQUE INDEX room_invitations_one_pending ON room_invitations (room_id, company_id) WHERE status = 'pending';
CREATE INDEX room_invitations_company_status_pos ON room_invitations (company_id, status, pos);
-- The invitations a company sent (ListInvitations with sent).
CREATE INDEX room_invitations_inviter_status_pos ON room_invitations (invited_by_company_id, status, pos);
-- A room's invitations (ListRoomInvitations, for its creator).
CREATE INDEX room_invitations_room_status_pos ON room_invitations (room_id, status, pos);

CREATE TABLE agents (
    agent_id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    company_id uuid NOT NULL REFERENCES companies (company_id),
    pos bigint GENERATED ALWAYS AS IDENTITY,
    name text NOT NULL,
    provider text NOT NULL CHECK (provider IN ('anthropic', 'openai', 'openai_compatible')),
    model text NOT NULL,
    base_url text,
    -- Fernet token of the company's provider key (quayutec.crypto); never the plaintext.
    provider_key_encrypted bytea,
    system_prompt text NOT NULL DEFAULT '',
    created_at timestamptz NOT NULL DEFAULT now(),
    -- The company's idempotency key: a repeat with it answers this agent.
    dedupe_key text,
    -- Set when its company retired it: it wakes no more; its runs and messages stay (NULL: active).
    retired_at timestamptz
);
CREATE UNIQUE INDEX agents_company_dedupe_key ON agents (company_id, dedupe_key);
-- An agent's name is unique within its company (retired agents' too), compared as the CLI resolves
-- names (stored trimmed, case ignored).
CREATE UNIQUE INDEX agents_company_name ON agents (company_id, lower(name));
CREATE INDEX agents_company_pos ON agents (company_id, pos);

CREATE TABLE messages (
    message_id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    room_id uuid NOT NULL REFERENCES rooms (room_id),
    seq bigint NOT NULL,
    author_kind text NOT NULL CHECK (author_kind IN ('person', 'agent')),
    author_company_id uuid NOT NULL REFERENCES companies (company_id),
    author_person text,
    -- The issuer that verified author_person at sign-in (NULL: stated by the company's service).
    author_verified_by text,
    author_agent_id uuid REFERENCES agents (agent_id),
    body text NOT NULL,
    mention_agent_ids uuid[] NOT NULL DEFAULT '{}',
    run_id text,
    dedupe_key text,
    created_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT messages_room_seq_key UNIQUE (room_id, seq),
    CONSTRAINT messages_room_dedupe_key UNIQUE (room_id, dedupe_key),
    CONSTRAINT messages_author_check CHECK ((author_kind = 'agent') = (author_agent_id IS NOT NULL))
);

CREATE TABLE tasks (
    task_id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    room_id uuid NOT NULL REFERENCES rooms (room_id),
    pos bigint GENERATED ALWAYS AS IDENTITY,
    from_kind text NOT NULL CHECK (from_kind IN ('person', 'agent')),
    from_company_id uuid NOT NULL REFERENCES companies (company_id),
    from_person text,
    from_verified_by text,
    from_agent_id uuid REFERENCES agents (agent_id),
    to_agent_id uuid NOT NULL REFERENCES agents (agent_id),
    title text NOT NULL,
    body text NOT NULL DEFAULT '',
    -- A task stays open until an update closes it.
    status text NOT NULL DEFAULT 'open' CHECK (status IN ('open', 'done', 'cancelled')),
    run_id text,
    dedupe_key text,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT tasks_room_dedupe_key UNIQUE (room_id, dedupe_key),
    CONSTRAINT tasks_from_check CHECK ((from_kind = 'agent') = (from_agent_id IS NOT NULL))
);
CREATE INDEX tasks_room_pos ON tasks (room_id, pos);
CREATE INDEX tasks_to_agent_pos ON tasks (to_agent_id, pos);

CREATE TABLE task_updates (
    update_id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    task_id uuid NOT NULL REFERENCES tasks (task_id),
    pos bigint GENERATED ALWAYS AS IDENTITY,
    author_kind text NOT NULL CHECK (author_kind IN ('person', 'agent')),
    author_company_id uuid NOT NULL REFERENCES companies (company_id),
    author_person text,
    author_agent_id uuid REFERENCES agents (agent_id),
    note text NOT NULL DEFAULT '',
    -- The task's status after this update.
    status text NOT NULL CHECK (status IN ('open', 'done', 'cancelled')),
    run_id text,
    dedupe_key text,
    created_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT task_updates_task_dedupe_key UNIQUE (task_id, dedupe_key),
    CONSTRAINT task_updates_author_check CHECK ((author_kind = 'agent') = (author_agent_id IS NOT NULL))
);
CREATE INDEX task_updates_task_pos ON task_updates (task_id, pos);

CREATE TABLE memory_lines (
    memory_id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    room_id uuid NOT NULL REFERENCES rooms (room_id),
    pos bigint GENERATED ALWAYS AS IDENTITY,
    author_kind text NOT NULL CHECK (author_kind IN ('person', 'agent')),
    author_company_id uuid NOT NULL REFERENCES companies (company_id),
    author_person text,
    author_agent_id uuid REFERENCES agents (agent_id),
    text text NOT NULL,
    -- 'room': every member company reads it; 'company': only author_company_id and its agents.
    visibility text NOT NULL CHECK (visibility IN ('room', 'company')),
    run_id text,
    dedupe_key text,
    created_at timestamptz NOT NULL DEFAULT now(),
    tsv tsvector GENERATED ALWAYS AS (to_tsvector('english'::regconfig, text)) STORED,
    CONSTRAINT memory_lines_room_dedupe_key UNIQUE (room_id, dedupe_key),
    CONSTRAINT memory_lines_author_check CHECK ((author_kind = 'agent') = (author_agent_id IS NOT NULL))
);
CREATE INDEX memory_lines_room_pos ON memory_lines (room_id, pos);
CREATE INDEX memory_lines_tsv ON memory_lines USING gin (tsv);

CREATE TABLE files (
    file_id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    room_id uuid NOT NULL REFERENCES rooms (room_id),
    pos bigint GENERATED ALWAYS AS IDENTITY,
    author_kind text NOT NULL CHECK (author_kind IN ('person', 'agent')),
    author_company_id uuid NOT NULL REFERENCES companies (company_id),
    author_person text,
    author_agent_id uuid REFERENCES agents (agent_id),
    name text NOT NULL,
    content_type text NOT NULL DEFAULT '',
    content bytea NOT NULL,
    size_bytes bigint NOT NULL,
    passage_count integer NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT files_author_check CHECK ((author_kind = 'agent') = (author_agent_id IS NOT NULL))
);
CREATE INDEX files_room_pos ON files (room_id, pos);

CREATE TABLE passages (
    passage_id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    file_id uuid NOT NULL REFERENCES files (file_id),
    room_id uuid NOT NULL REFERENCES rooms (room_id),
    ordinal integer NOT NULL,
    text text NOT NULL,
    tsv tsvector GENERATED ALWAYS AS (to_tsvector('english'::regconfig, text)) STORED,
    CONSTRAINT passages_file_ordinal_key UNIQUE (file_id, ordinal)
);
CREATE INDEX passages_room ON passages (room_id);
CREATE INDEX passages_tsv ON passages USING gin (tsv);

-- The run ledger: one row per run, rewritten whole by RecordRun until it has ended.
CREATE TABLE runs (
    run_id text PRIMARY KEY,
    pos bigint GENERATED ALWAYS AS IDENTITY,
    agent_id uuid NOT NULL,
    company_id uuid,
    room_id uuid NOT NULL,
    wake_id text NOT NULL DEFAULT '',
    wake_kind text NOT NULL DEFAULT 'unspecified',
    wake_source_id text NOT NULL DEFAULT '',
    status text NOT NULL DEFAULT 'unspecified',
    step text NOT NULL DEFAULT 'unspecified',
    posted_message_id text NOT NULL DEFAULT '',
    actions jsonb NOT NULL DEFAULT '[]',
    model_attempts jsonb NOT NULL DEFAULT '[]',
    error text NOT NULL DEFAULT '',
    trace_id text NOT NULL DEFAULT '',
    active_ms bigint NOT NULL DEFAULT 0,
    started_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now(),
    ended_at timestamptz,
    -- The delivery whose run holds the row (its claimant token; '' on a not_started row): the fence
    -- that lets at most one run of a wake read the room (upsert_run_with_before).
    attempt text NOT NULL DEFAULT '',
    -- Every trace id of the run, oldest first (trace_id is the first).
    trace_ids text[] NOT NULL DEFAULT '{}'
);
CREATE INDEX runs_agent_pos ON runs (agent_id, pos);
CREATE INDEX runs_company_pos ON runs (company_id, pos);
-- ListRuns' filters: a company's runs in one room, with one status, started in a time range.
CREATE INDEX runs_company_room_pos ON runs (company_id, room_id, pos);
CREATE INDEX runs_company_status_pos ON runs (company_id, status, pos);
CREATE INDEX runs_company_started ON runs (company_id, started_at);
-- Runs not ended, for the housekeeping that ends stale ones.
CREATE INDEX runs_open ON runs (status, updated_at) WHERE ended_at IS NULL;

-- The outbox: a wake per agent a message or task is meant for, written in the posting transaction
-- and leased by Gateway's delivery loop (FOR UPDATE SKIP LOCKED).
CREATE TABLE wake_outbox (
    wake_id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    agent_id uuid NOT NULL REFERENCES agents (agent_id),
    room_id uuid NOT NULL REFERENCES rooms (room_id),
    kind text NOT NULL CHECK (kind IN ('message', 'task', 'decision')),
    source_id text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    due_at timestamptz NOT NULL DEFAULT now(),
    lease_owner text,
    lease_expires_at timestamptz,
    delivery_attempts integer NOT NULL DEFAULT 0,
    delivered_at timestamptz,
    last_error text,
    -- Housekeeping looked for the ledger row of this undelivered wake's run (and wrote a not_started
    -- one when there was none); a wake is looked at once.
    run_checked boolean NOT NULL DEFAULT false,
    -- The W3C trace context of the span whose transaction created the wake ('' when not traced).
    traceparent text NOT NULL DEFAULT '',
    CONSTRAINT wake_outbox_source_key UNIQUE (agent_id, kind, source_id)
);
CREATE INDEX wake_outbox_pending_due ON wake_outbox (due_at) WHERE delivered_at IS NULL;
CREATE INDEX wake_outbox_source ON wake_outbox (source_id);
-- Delivered wakes by age, for the cleanup loop (pending rows are not in it).
CREATE INDEX wake_outbox_delivered ON wake_outbox (delivered_at) WHERE delivered_at IS NOT NULL;

-- A company's rules for its agents' declared actions: its default (agent_id NULL) and per-agent rows.
CREATE TABLE agent_rights (
    company_id uuid NOT NULL REFERENCES companies (company_id),
    -- NULL: the company's default for all its agents.
    agent_id uuid REFERENCES agents (agent_id),
    -- Each right is 'auto', 'hold' or 'deny'; NULL: not set here (the default applies, then 'auto').
    remember text CHECK (remember IN ('auto', 'hold', 'deny')),
    create_task text CHECK (create_task IN ('auto', 'hold', 'deny')),
    update_task text CHECK (update_task IN ('auto', 'hold', 'deny')),
    close_task text CHECK (close_task IN ('auto', 'hold', 'deny')),
    cross_company_task text CHECK (cross_company_task IN ('auto', 'hold', 'deny')),
    updated_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT agent_rights_company_agent_key UNIQUE NULLS NOT DISTINCT (company_id, agent_id)
);

-- A parked run: no process waits on it; the decision that completes it (or its expiry) records a
-- 'decision' wake with source_id = token in the same transaction.
CREATE TABLE waitpoints (
    token uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    pos bigint GENERATED ALWAYS AS IDENTITY,
    run_id text NOT NULL CONSTRAINT waitpoints_run_key UNIQUE REFERENCES runs (run_id),
    agent_id uuid NOT NULL REFERENCES agents (agent_id),
    -- The agent's owning company: the only one that decides.
    company_id uuid NOT NULL REFERENCES companies (company_id),
    room_id uuid NOT NULL REFERENCES rooms (room_id),
    status text NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'completed', 'expired')),
    created_at timestamptz NOT NULL DEFAULT now(),
    expires_at timestamptz NOT NULL,
    -- The W3C trace context of the span that parked the run ('' when not traced).
    traceparent text NOT NULL DEFAULT ''
);
CREATE INDEX waitpoints_company_status_pos ON waitpoints (company_id, status, pos);
CREATE INDEX waitpoints_pending_expiry ON waitpoints (expires_at) WHERE status = 'pending';

CREATE TABLE held_actions (
    token uuid NOT NULL REFERENCES waitpoints (token),
    -- The action's index in the run's ledger row.
    action_index integer NOT NULL,
    kind text NOT NULL CHECK (kind IN ('remember', 'create_task', 'update_task', 'close_task')),
    arguments_json text NOT NULL,
    decision text NOT NULL DEFAULT 'pending' CHECK (decision IN ('pending', 'approved', 'denied')),
    decided_by text,
    decided_at timestamptz,
    -- The issuer that verified decided_by at sign-in (NULL: stated by the company's service).
    decided_by_verified_by text,
    PRIMARY KEY (token, action_index),
    CONSTRAINT held_actions_decided_check CHECK ((decision = 'pending') = (decided_at IS NULL))
);

-- New wakes notify listening Gateways at commit (LISTEN quayutec_wakes), so delivery need not wait for its
-- next poll; wakes written already leased (a post's, leased to the posting Gateway) notify no one.
CREATE FUNCTION notify_new_wakes() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM new_wakes WHERE lease_owner IS NULL) THEN
        PERFORM pg_notify('quayutec_wakes', '');
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER wake_outbox_notify
    AFTER INSERT ON wake_outbox
    REFERENCING NEW TABLE AS new_wakes
    FOR EACH STATEMENT EXECUTE FUNCTION notify_new_wakes();

-- The room event log (outbox-style, gap-free cursor per room), NOTIFYed at commit.
CREATE TABLE room_events (
    room_id uuid NOT NULL REFERENCES rooms (room_id),
    -- Taken from rooms.last_event_seq under the room row's lock: commit order is cursor order.
    seq bigint NOT NULL,
    kind text NOT NULL,
    -- A serialized quayutec.v1.RoomEvent (kind and the changed resource; cursor and time are filled on read),
    -- or NULL when snapshot holds the changed row.
    detail bytea,
    -- NULL: every member company sees it; otherwise only this company (its private memory, runs, approvals).
    audience_company_id uuid REFERENCES companies (company_id),
    created_at timestamptz NOT NULL DEFAULT now(),
    -- The changed row as jsonb (a messages or runs row, by kind), written by the write's own statement;
    -- read_room_events rebuilds the row from it.
    snapshot jsonb,
    PRIMARY KEY (room_id, seq),
    CONSTRAINT room_events_detail_or_snapshot CHECK ((detail IS NULL) <> (snapshot IS NULL))
);
CREATE INDEX room_events_created_at ON room_events (created_at);

-- One notification per room per transaction (PostgreSQL folds equal payloads), delivered at commit.
CREATE FUNCTION notify_room_events() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    changed record;
BEGIN
    FOR changed IN SELECT DISTINCT room_id FROM new_events LOOP
        PERFORM pg_notify('quayutec_room_events', changed.room_id::text);
    END LOOP;
    RETURN NULL;
END
$$;

CREATE TRIGGER room_events_notify
    AFTER INSERT ON room_events
    REFERENCING NEW TABLE AS new_events
    FOR EACH STATEMENT EXECUTE FUNCTION notify_room_events();

-- Fewer round trips per RPC: ReadRunContext reads its whole view in one statement, its lists as
-- arrays of these row types (asyncpg decodes a named composite type as a record with field names).
CREATE TYPE room_context_agent AS (
    agent_id uuid,
    company_id uuid,
    name text,
    provider text,
    model text,
    base_url text,
    system_prompt text,
    has_provider_key boolean,
    created_at timestamptz
);
CREATE TYPE room_context_memory AS (
    memory_id uuid,
    room_id uuid,
    author_kind text,
    author_company_id uuid,
    author_person text,
    author_agent_id uuid,
    text text,
    visibility text,
    run_id text,
    created_at timestamptz,
    pos bigint
);
CREATE TYPE room_context_passage AS (
    passage_id uuid,
    file_id uuid,
    file_name text,
    ordinal integer,
    text text,
    rank real
);

-- A run's open tasks (ReadRunContext, ListTasks of one assignee's open tasks): an index of the open ones
-- alone, so closed tasks, however many, are never scanned.
CREATE INDEX tasks_open_to_agent ON tasks (room_id, to_agent_id, pos) WHERE status = 'open';
