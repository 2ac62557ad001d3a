-- All SQL of the Gateway: API keys.

-- name: insert_api_key
INSERT INTO api_keys (key_id, company_id, key_hash, label)
VALUES ($1, $2, $3, $4)
RETURNING key_id, company_id, label, created_at, revoked_at;

-- name: get_api_key
-- One indexed lookup per authenticated call; no cache, so a revoke takes effect at once.
SELECT key_id, company_id, key_hash, revoked_at
FROM api_keys
WHERE key_id = $1;

-- name: revoke_api_key
UPDATE api_keys
SET revoked_at = coalesce(revoked_at, now())
WHERE key_id = $1
RETURNING key_id;

-- name: list_api_keys
SELECT key_id, company_id, label, created_at, revoked_at
FROM api_keys
WHERE company_id = $1
ORDER BY created_at, key_id;
