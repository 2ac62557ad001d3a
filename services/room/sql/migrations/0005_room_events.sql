-- The room event log: every change a member can see, appended in the transaction of the change
-- (outbox-style) with a gap-free per-room cursor, and NOTIFYed to listening Gateways at commit.
ALTER TABLE rooms ADD COLUMN last_event_seq bigint NOT NULL DEFAULT 0;
-- The newest cursor removed by retention cleanup: a watcher resuming from an older cursor has lost events.
ALTER TABLE rooms ADD COLUMN events_pruned_through bigint NOT NULL DEFAULT 0;

CREATE TABLE room_events (
    room_id uuid NOT NULL REFERENCES rooms (room_id),
    -- Taken from rooms.last_event_seq under the room row's lock: commit order is cursor order.
    seq bigint NOT NULL,
    kind text NOT NULL,
    -- A serialized quayutec.v1.RoomEvent (kind and the changed resource; cursor and time are filled on read).
    detail bytea NOT NULL,
    -- NULL: every member company sees it; otherwise only this company (its private memory, runs, approvals).
    audience_company_id uuid REFERENCES companies (company_id),
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (room_id, seq)
);
CREATE INDEX room_events_created_at ON room_events (created_at);

-- One notification per room per transaction (PostgreSQL folds equal payloads), delivered at commit.
CREATE FUNCTION notify_room_events() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    changed record;
BEGIN
    FOR changed IN SELECT DISTINCT room_id FROM new_events LOOP
        PERFORM pg_notify('quayutec_room_events', changed.room_id::text);
    END LOOP;
    RETURN NULL;
END
$$;

CREATE TRIGGER room_events_notify
    AFTER INSERT ON room_events
    REFERENCING NEW TABLE AS new_events
    FOR EACH STATEMENT EXECUTE FUNCTION notify_room_events();
