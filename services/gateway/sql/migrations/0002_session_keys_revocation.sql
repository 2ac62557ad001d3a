-- Session keys (short-lived keys a console sign-in makes from a company key, revoked with it) and
-- a notification to every Gateway replica when a key is revoked, so its open streams end at once.
ALTER TABLE api_keys
    ADD COLUMN parent_key_id uuid REFERENCES api_keys (key_id),
    ADD COLUMN expires_at timestamptz,
    ADD CONSTRAINT api_keys_session_expires_check CHECK ((parent_key_id IS NULL) = (expires_at IS NULL));

CREATE INDEX api_keys_parent_idx ON api_keys (parent_key_id, expires_at) WHERE parent_key_id IS NOT NULL;

CREATE FUNCTION api_key_revoked() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE api_keys SET revoked_at = NEW.revoked_at WHERE parent_key_id = NEW.key_id AND revoked_at IS NULL;
    PERFORM pg_notify('quayutec_keys_revoked', NEW.key_id::text);
    RETURN NULL;
END
$$;

CREATE TRIGGER api_keys_revoked
    AFTER UPDATE OF revoked_at ON api_keys
    FOR EACH ROW WHEN (OLD.revoked_at IS NULL AND NEW.revoked_at IS NOT NULL)
    EXECUTE FUNCTION api_key_revoked();
