-- Membership by consent: inviting a company records an invitation; it becomes a member when it accepts.
-- Rooms created before this migration keep their members as they are.
CREATE TABLE room_invitations (
    invitation_id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    room_id uuid NOT NULL REFERENCES rooms (room_id),
    company_id uuid NOT NULL REFERENCES companies (company_id),
    invited_by_company_id uuid NOT NULL REFERENCES companies (company_id),
    pos bigint GENERATED ALWAYS AS IDENTITY,
    status text NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'accepted', 'declined')),
    created_at timestamptz NOT NULL DEFAULT now(),
    responded_at timestamptz,
    CONSTRAINT room_invitations_responded_check CHECK ((status = 'pending') = (responded_at IS NULL))
);
CREATE UNIQUE INDEX room_invitations_one_pending ON room_invitations (room_id, company_id) WHERE status = 'pending';
CREATE INDEX room_invitations_company_status_pos ON room_invitations (company_id, status, pos);
