-- The Gateway's schema as it now stands (migrations/ build it step by step).

-- API keys of companies (companies themselves live in the Room). The secret is
-- qyk_<key_id>_<random>; only its SHA-256 is kept, looked up by key_id.
-- A session key (a console sign-in) has a parent key, the company key that made it, and an expiry;
-- revoking the parent revokes it too.
CREATE TABLE api_keys (
    key_id uuid PRIMARY KEY,
    company_id uuid NOT NULL,
    key_hash bytea NOT NULL,
    label text NOT NULL DEFAULT '',
    created_at timestamptz NOT NULL DEFAULT now(),
    revoked_at timestamptz,
    parent_key_id uuid REFERENCES api_keys (key_id),
    expires_at timestamptz,
    -- The person a sign-in through the company's OpenID provider verified (session keys of such sign-ins).
    person_issuer text,
    person_subject text,
    person_name text,
    person_email text,
    CONSTRAINT api_keys_session_expires_check CHECK ((parent_key_id IS NULL) = (expires_at IS NULL)),
    -- The idempotency key of a keyed CreateApiKey or CreateSessionKey, and only then the secret, as a
    -- Fernet token (a repeat answers the same secret).
    dedupe_key text,
    secret_sealed bytea
);
CREATE UNIQUE INDEX api_keys_company_dedupe_key ON api_keys (company_id, dedupe_key);

CREATE INDEX api_keys_company_idx ON api_keys (company_id, created_at);
CREATE INDEX api_keys_parent_idx ON api_keys (parent_key_id, expires_at) WHERE parent_key_id IS NOT NULL;

-- A revoked key's session keys are revoked with it, and every Gateway replica LISTENing on
-- quayutec_keys_revoked is told at commit (payload: the key id), so the key's open streams end.
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

-- The OpenID Connect provider each company's people sign in to the console with. The client secret is
-- a Fernet token (the cipher of agents' provider keys). Its session keys are made under key_id, a
-- company key never handed out: revoking it, or replacing the provider, ends those sign-ins.
CREATE TABLE sign_in_providers (
    company_id uuid PRIMARY KEY,
    company_name text NOT NULL,
    issuer text NOT NULL,
    client_id text NOT NULL,
    client_secret_sealed bytea NOT NULL,
    email_domains text[] NOT NULL DEFAULT '{}',
    allow_api_key_sign_in boolean NOT NULL DEFAULT false,
    key_id uuid NOT NULL REFERENCES api_keys (key_id),
    updated_at timestamptz NOT NULL DEFAULT now()
);

CREATE UNIQUE INDEX sign_in_providers_name_idx ON sign_in_providers (lower(company_name));

-- Each email domain picks at most one company's provider.
CREATE TABLE sign_in_domains (
    domain text PRIMARY KEY,
    company_id uuid NOT NULL REFERENCES sign_in_providers (company_id) ON DELETE CASCADE
);
