-- 0008 is the room-rules branch's migration; this placeholder keeps the numbers without a gap
-- until it merges, and is deleted then.
SELECT 1;
