-- All SQL of the Gateway: API keys, session keys and their revocation.

-- name: insert_api_key
INSERT INTO api_keys (key_id, company_id, key_hash, label)
VALUES ($1, $2, $3, $4)
RETURNING key_id, company_id, label, created_at, revoked_at, parent_key_id, expires_at;

-- name: insert_session_key
-- A session key of the live company key $4 (never of another session key), living $5 seconds; the
-- parent row is share-locked, so a concurrent revocation of it either comes first (nothing is made)
-- or waits for this insert and revokes it too. Nothing when the parent is revoked or has $6 live ones.
-- A keyed call stores its dedupe key $7 and sealed secret $8 (both NULL otherwise).
INSERT INTO api_keys (key_id, company_id, key_hash, label, parent_key_id, expires_at, dedupe_key, secret_sealed)
SELECT $1, parent.company_id, $2, $3, parent.key_id, now() + make_interval(secs => $5), $7, $8
FROM (
    SELECT key_id, company_id FROM api_keys
    WHERE key_id = $4 AND revoked_at IS NULL AND parent_key_id IS NULL
    FOR SHARE
) parent
WHERE (
    SELECT count(*) FROM api_keys
    WHERE parent_key_id = $4 AND revoked_at IS NULL AND expires_at > now()
) < $6
RETURNING key_id, company_id, label, created_at, revoked_at, parent_key_id, expires_at;

-- name: get_api_key
-- One indexed lookup per authenticated call; no cache, so a revoke takes effect at once. A session
-- key counts as revoked when its parent is (the trigger revokes it too; this covers the race).
SELECT k.key_id, k.company_id, k.key_hash, k.parent_key_id, k.expires_at, k.expires_at <= now() AS expired,
    (k.revoked_at IS NOT NULL OR parent.revoked_at IS NOT NULL) AS revoked,
    k.person_issuer, k.person_subject, k.person_name, k.person_email
FROM api_keys k
LEFT JOIN api_keys parent ON parent.key_id = k.parent_key_id
WHERE k.key_id = $1;

-- name: revoke_api_key
-- The trigger api_keys_revoked revokes its session keys and NOTIFYs quayutec_keys_revoked.
UPDATE api_keys
SET revoked_at = coalesce(revoked_at, now())
WHERE key_id = $1
RETURNING key_id;

-- name: dead_keys
-- Of the key ids $1 (the keys of open streams), those no longer usable: unknown, revoked (or their
-- parent is), or expired.
SELECT ids.key_id
FROM unnest($1::uuid[]) AS ids (key_id)
LEFT JOIN api_keys k ON k.key_id = ids.key_id
LEFT JOIN api_keys parent ON parent.key_id = k.parent_key_id
WHERE k.key_id IS NULL OR k.revoked_at IS NOT NULL OR parent.revoked_at IS NOT NULL OR k.expires_at <= now();

-- name: prune_session_keys
-- Removes up to $2 session keys expired more than $1 seconds ago.
DELETE FROM api_keys
WHERE key_id IN (
    SELECT key_id FROM api_keys
    WHERE parent_key_id IS NOT NULL AND expires_at < now() - make_interval(secs => $1)
    LIMIT $2
);

-- name: list_api_keys
-- A company's keys, its session keys only when $2.
SELECT key_id, company_id, label, created_at, revoked_at, parent_key_id, expires_at
FROM api_keys
WHERE company_id = $1 AND ($2 OR parent_key_id IS NULL)
ORDER BY created_at, key_id;

-- name: notify_company_rooms
-- Tells every Gateway replica that the rooms of company $1 changed (it joined or made one), so its
-- WatchRooms streams follow the new room at once.
SELECT pg_notify('quayutec_company_rooms', $1::text);

-- name: lock_company_keys
-- Serializes CreateApiKey of one company (held to the end of the transaction), so two keys made at
-- once cannot both pass the count of insert_company_key.
SELECT pg_advisory_xact_lock(hashtextextended('quayutec api keys ' || $1::text, 0));

-- name: insert_company_key
-- A company key of company $2, unless it already has $5 live ones (no row then). A keyed call stores
-- its dedupe key $6 and sealed secret $7 (both NULL otherwise).
INSERT INTO api_keys (key_id, company_id, key_hash, label, dedupe_key, secret_sealed)
SELECT $1, $2, $3, $4, $6, $7
WHERE (
    SELECT count(*) FROM api_keys WHERE company_id = $2 AND parent_key_id IS NULL AND revoked_at IS NULL
) < $5
RETURNING key_id, company_id, label, created_at, revoked_at, parent_key_id, expires_at;

-- name: find_keyed_key
-- The key company $1 made with dedupe key $2, and its sealed secret.
SELECT key_id, company_id, label, created_at, revoked_at, parent_key_id, expires_at, secret_sealed
FROM api_keys WHERE company_id = $1 AND dedupe_key = $2;

-- name: list_api_keys_page
-- A page of company $1's keys, oldest first, after ($3 created_at, $4 key_id); its session keys too when $2.
SELECT key_id, company_id, label, created_at, revoked_at, parent_key_id, expires_at
FROM api_keys
WHERE company_id = $1 AND ($2 OR parent_key_id IS NULL) AND (created_at, key_id) > ($3, $4)
ORDER BY created_at, key_id
LIMIT $5;

-- name: revoke_company_key
-- Revokes key $1 if it is company $2's (a revoked one stays as it was); the key as it now stands.
UPDATE api_keys
SET revoked_at = coalesce(revoked_at, now())
WHERE key_id = $1 AND company_id = $2
RETURNING key_id, company_id, label, created_at, revoked_at, parent_key_id, expires_at;

-- name: insert_person_session_key
-- A session key of a sign-in through the company's OpenID provider: made under the provider's key $4
-- (as insert_session_key does), carrying the verified person ($7 issuer, $8 subject, $9 name, $10 email).
INSERT INTO api_keys (
    key_id, company_id, key_hash, label, parent_key_id, expires_at,
    person_issuer, person_subject, person_name, person_email
)
SELECT $1, parent.company_id, $2, $3, parent.key_id, now() + make_interval(secs => $5), $7, $8, $9, $10
FROM (
    SELECT key_id, company_id FROM api_keys
    WHERE key_id = $4 AND revoked_at IS NULL AND parent_key_id IS NULL
    FOR SHARE
) parent
WHERE (
    SELECT count(*) FROM api_keys
    WHERE parent_key_id = $4 AND revoked_at IS NULL AND expires_at > now()
) < $6
RETURNING key_id, company_id, label, created_at, revoked_at, parent_key_id, expires_at;

-- name: get_sign_in_provider
SELECT company_id, company_name, issuer, client_id, client_secret_sealed, email_domains, allow_api_key_sign_in,
    key_id, updated_at
FROM sign_in_providers
WHERE company_id = $1;

-- name: find_sign_in_provider_by_name
SELECT company_id, company_name, issuer, client_id, client_secret_sealed, email_domains, allow_api_key_sign_in,
    key_id, updated_at
FROM sign_in_providers
WHERE lower(company_name) = lower($1);

-- name: find_sign_in_provider_by_domain
SELECT p.company_id, p.company_name, p.issuer, p.client_id, p.client_secret_sealed, p.email_domains,
    p.allow_api_key_sign_in, p.key_id, p.updated_at
FROM sign_in_domains d
JOIN sign_in_providers p ON p.company_id = d.company_id
WHERE d.domain = lower($1);

-- name: lock_sign_in_provider
-- Serializes SetSignInProvider and RemoveSignInProvider of company $1 (to the end of the transaction).
SELECT pg_advisory_xact_lock(hashtextextended('quayutec sign-in provider ' || $1::text, 0));

-- name: upsert_sign_in_provider
-- Company $1's provider; $8 is the company key its sign-ins are made under.
INSERT INTO sign_in_providers (
    company_id, company_name, issuer, client_id, client_secret_sealed, email_domains, allow_api_key_sign_in, key_id
)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
ON CONFLICT (company_id) DO UPDATE SET
    company_name = excluded.company_name,
    issuer = excluded.issuer,
    client_id = excluded.client_id,
    client_secret_sealed = excluded.client_secret_sealed,
    email_domains = excluded.email_domains,
    allow_api_key_sign_in = excluded.allow_api_key_sign_in,
    key_id = excluded.key_id,
    updated_at = now()
RETURNING company_id, company_name, issuer, client_id, client_secret_sealed, email_domains, allow_api_key_sign_in,
    key_id, updated_at;

-- name: domains_of_others
-- Of the domains $2, those another company's provider serves.
SELECT domain FROM sign_in_domains WHERE domain = ANY ($2::text[]) AND company_id <> $1;

-- name: clear_sign_in_domains
DELETE FROM sign_in_domains WHERE company_id = $1;

-- name: insert_sign_in_domains
INSERT INTO sign_in_domains (domain, company_id)
SELECT unnest($2::text[]), $1;

-- name: delete_sign_in_provider
-- Removes company $1's provider (its domains with it); the key its sign-ins were made under.
DELETE FROM sign_in_providers WHERE company_id = $1 RETURNING key_id;
