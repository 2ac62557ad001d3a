-- The Gateway's schema as it now stands (migrations/ build it step by step).

-- API keys of companies (companies themselves live in the Room). The secret is
-- qyk_<key_id>_<random>; only its SHA-256 is kept, looked up by key_id.
CREATE TABLE api_keys (
    key_id uuid PRIMARY KEY,
    company_id uuid NOT NULL,
    key_hash bytea NOT NULL,
    label text NOT NULL DEFAULT '',
    created_at timestamptz NOT NULL DEFAULT now(),
    revoked_at timestamptz
);

CREATE INDEX api_keys_company_idx ON api_keys (company_id, created_at);
