-- 0002: each claim names its claimant, the token its caller chose for one delivery, so the caller
-- can ask again after losing the answer. Claims made before this have none ('').
ALTER TABLE agent_run_locks
    ADD COLUMN claimant text NOT NULL DEFAULT '',
    ADD CONSTRAINT agent_run_locks_claimant_size CHECK (octet_length(claimant) <= 200);
