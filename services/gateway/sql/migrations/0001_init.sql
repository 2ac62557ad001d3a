-- API keys of companies, stored hashed.
CREATE TABLE api_keys (
    key_id uuid PRIMARY KEY,
    company_id uuid NOT NULL,
    key_hash bytea NOT NULL,
    label text NOT NULL DEFAULT '',
    created_at timestamptz NOT NULL DEFAULT now(),
    revoked_at timestamptz
);

CREATE INDEX api_keys_company_idx ON api_keys (company_id, created_at);
