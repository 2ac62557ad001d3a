-- Idempotency keys on CreateApiKey and CreateSessionKey: a repeat from the same company answers the
-- first key, its secret too, so only keyed creates keep the secret (a Fernet token, the cipher of
-- sign-in providers' client secrets). Keys are unique per company (NULL: no key).
ALTER TABLE api_keys
    ADD COLUMN dedupe_key text,
    ADD COLUMN secret_sealed bytea;
CREATE UNIQUE INDEX api_keys_company_dedupe_key ON api_keys (company_id, dedupe_key);
