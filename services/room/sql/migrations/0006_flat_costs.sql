-- Costs that stay flat as the tables grow.
-- Delivered wakes are deleted by age (QUAYUTEC_ROOM_DELIVERED_WAKES_KEEP_SECONDS): an index of them alone.
CREATE INDEX wake_outbox_delivered ON wake_outbox (delivered_at) WHERE delivered_at IS NOT NULL;
-- The Gateway's housekeeping looks for stale RUNNING and PARKED rows every few seconds: an index of
-- the runs not ended (a few), not a scan of the whole ledger (millions).
CREATE INDEX runs_open ON runs (status, updated_at) WHERE ended_at IS NULL;
