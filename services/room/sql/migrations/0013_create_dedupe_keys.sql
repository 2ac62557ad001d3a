-- Idempotency keys on creates: a repeat of a room, invitation or agent creation with the same key from
-- the same company answers the first one. Keys are unique per company (NULL: no key).
ALTER TABLE rooms ADD COLUMN dedupe_key text;
CREATE UNIQUE INDEX rooms_company_dedupe_key ON rooms (created_by_company_id, dedupe_key);
ALTER TABLE room_invitations ADD COLUMN dedupe_key text;
CREATE UNIQUE INDEX room_invitations_inviter_dedupe_key ON room_invitations (invited_by_company_id, dedupe_key);
ALTER TABLE agents ADD COLUMN dedupe_key text;
CREATE UNIQUE INDEX agents_company_dedupe_key ON agents (company_id, dedupe_key);
