-- New wakes notify listening Gateways at commit (LISTEN quayutec_wakes), so delivery need not wait
-- for its next poll. One notification per inserting statement; PostgreSQL folds repeats per transaction.
CREATE FUNCTION notify_new_wakes() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM new_wakes) THEN
        PERFORM pg_notify('quayutec_wakes', '');
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER wake_outbox_notify
    AFTER INSERT ON wake_outbox
    REFERENCING NEW TABLE AS new_wakes
    FOR EACH STATEMENT EXECUTE FUNCTION notify_new_wakes();
