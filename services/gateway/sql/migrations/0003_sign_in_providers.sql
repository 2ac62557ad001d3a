-- Console sign-in through a company's OpenID Connect provider: the provider of each company, the email
-- domains it serves, and the verified person a session key made by a sign-in carries.
CREATE TABLE sign_in_providers (
    company_id uuid PRIMARY KEY,
    company_name text NOT NULL,
    issuer text NOT NULL,
    client_id text NOT NULL,
    -- Fernet token of the client secret (the same cipher as agents' provider keys).
    client_secret_sealed bytea NOT NULL,
    email_domains text[] NOT NULL DEFAULT '{}',
    allow_api_key_sign_in boolean NOT NULL DEFAULT false,
    -- The company key the provider's session keys are made under (never handed out): revoking it, or
    -- replacing the provider, ends every sign-in made through it.
    key_id uuid NOT NULL REFERENCES api_keys (key_id),
    updated_at timestamptz NOT NULL DEFAULT now()
);

CREATE UNIQUE INDEX sign_in_providers_name_idx ON sign_in_providers (lower(company_name));

CREATE TABLE sign_in_domains (
    domain text PRIMARY KEY,
    company_id uuid NOT NULL REFERENCES sign_in_providers (company_id) ON DELETE CASCADE
);

ALTER TABLE api_keys
    ADD COLUMN person_issuer text,
    ADD COLUMN person_subject text,
    ADD COLUMN person_name text,
    ADD COLUMN person_email text;
