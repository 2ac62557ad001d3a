-- 0001: the claims table; a claim is one row per (agent, wake), never released.

-- One row per (agent, wake) ever claimed. A claim is never released, updated or deleted.
CREATE TABLE agent_run_locks (
    agent_id text NOT NULL,
    wake_id text NOT NULL,
    claimed_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT agent_run_locks_pkey PRIMARY KEY (agent_id, wake_id),
    CONSTRAINT agent_run_locks_agent_id_size CHECK (octet_length(agent_id) BETWEEN 1 AND 200),
    CONSTRAINT agent_run_locks_wake_id_size CHECK (octet_length(wake_id) BETWEEN 1 AND 200)
);
