-- 0009: each ledger row names the delivery whose run holds it, the fence that lets at most one run
-- of a wake read the room (rows written before have none: ''); and each wake remembers whether
-- housekeeping looked for its run's row while it waited to be delivered again.
ALTER TABLE runs ADD COLUMN attempt text NOT NULL DEFAULT '';
ALTER TABLE wake_outbox ADD COLUMN run_checked boolean NOT NULL DEFAULT false;
