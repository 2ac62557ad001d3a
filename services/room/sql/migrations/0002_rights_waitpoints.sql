-- 0002: agent rights (a company's default and per-agent rules) and waitpoints (parked runs and
-- their held actions, decided by the agent's owning company).

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
    expires_at timestamptz NOT NULL
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
    PRIMARY KEY (token, action_index),
    CONSTRAINT held_actions_decided_check CHECK ((decision = 'pending') = (decided_at IS NULL))
);
