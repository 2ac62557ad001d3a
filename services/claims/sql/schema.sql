-- The Claims schema as it now stands (kept equal to the migrations by tests/test_migrations.py).

-- One row per (agent, wake) ever claimed. A claim is never released, updated or deleted.
-- claimant: the token the caller chose for the delivery that made the claim ('' when none).
CREATE TABLE agent_run_locks (
    agent_id text NOT NULL,
    wake_id text NOT NULL,
    claimed_at timestamptz NOT NULL DEFAULT now(),
    claimant text NOT NULL DEFAULT '',
    CONSTRAINT agent_run_locks_pkey PRIMARY KEY (agent_id, wake_id),
    CONSTRAINT agent_run_locks_agent_id_size CHECK (octet_length(agent_id) BETWEEN 1 AND 200),
    CONSTRAINT agent_run_locks_wake_id_size CHECK (octet_length(wake_id) BETWEEN 1 AND 200),
    CONSTRAINT agent_run_locks_claimant_size CHECK (octet_length(claimant) <= 200)
);
