-- 0014: an event may carry the changed row itself (snapshot, the row as jsonb) instead of a serialized
-- RoomEvent, so a write appends its event in the same statement as the row it writes; read_room_events
-- rebuilds the row from it. Events written before keep their bytes; every event has one or the other.
ALTER TABLE room_events ALTER COLUMN detail DROP NOT NULL;
ALTER TABLE room_events ADD COLUMN snapshot jsonb;
ALTER TABLE room_events ADD CONSTRAINT room_events_detail_or_snapshot CHECK ((detail IS NULL) <> (snapshot IS NULL));
