-- 0010: trace links. Each wake keeps the trace context of the span whose transaction created it (the
-- post, the task or the decision) and each waitpoint that of the span that parked its run, so the
-- wake's delivery and the continuation link back to them; each ledger row keeps every trace id of its
-- run (the first one and one per continuation).
ALTER TABLE wake_outbox ADD COLUMN traceparent text NOT NULL DEFAULT '';
ALTER TABLE waitpoints ADD COLUMN traceparent text NOT NULL DEFAULT '';
ALTER TABLE runs ADD COLUMN trace_ids text[] NOT NULL DEFAULT '{}';
