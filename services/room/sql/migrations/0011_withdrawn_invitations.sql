-- 0011: an invitation can be withdrawn before it is answered: by the room's creator or its sender
-- (WithdrawInvitation), and at once when its sender's company leaves or is removed from the room.
ALTER TABLE room_invitations DROP CONSTRAINT room_invitations_status_check;
ALTER TABLE room_invitations ADD CONSTRAINT room_invitations_status_check
    CHECK (status IN ('pending', 'accepted', 'declined', 'withdrawn'));
-- A room's invitations (ListRoomInvitations, for its creator).
CREATE INDEX room_invitations_room_status_pos ON room_invitations (room_id, status, pos);
