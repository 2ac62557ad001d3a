-- The console's reads: a company's runs by room, by status and by start time (ListRuns' filters),
-- and the invitations a company sent (ListInvitations with sent).
CREATE INDEX IF NOT EXISTS runs_company_room_pos ON runs (company_id, room_id, pos);
CREATE INDEX IF NOT EXISTS runs_company_status_pos ON runs (company_id, status, pos);
CREATE INDEX IF NOT EXISTS runs_company_started ON runs (company_id, started_at);
CREATE INDEX IF NOT EXISTS room_invitations_inviter_status_pos ON room_invitations (invited_by_company_id, status, pos);
