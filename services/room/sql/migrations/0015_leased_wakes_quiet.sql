-- 0015: a post may write its wakes already leased to the Gateway that delivers them (post_message with a
-- lease owner); the new-wakes notification is sent only for a statement that wrote some wake no one
-- leases, so the other Gateways do not poll for wakes already taken.
CREATE OR REPLACE FUNCTION notify_new_wakes() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM new_wakes WHERE lease_owner IS NULL) THEN
        PERFORM pg_notify('quayutec_wakes', '');
    END IF;
    RETURN NULL;
END
$$;
