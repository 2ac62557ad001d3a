-- 0009 is the vanish branch's migration (the run fence); this placeholder keeps the numbers without a
-- gap until it merges, and is deleted then.
SELECT 1;
