-- Delivered wakes are deleted by age (QUAYUTEC_ROOM_DELIVERED_WAKES_KEEP_SECONDS): an index of them alone.
CREATE INDEX wake_outbox_delivered ON wake_outbox (delivered_at) WHERE delivered_at IS NOT NULL;
