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
