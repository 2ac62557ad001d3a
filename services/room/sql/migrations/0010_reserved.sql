-- 0010 is another branch's migration (0008 room rules, 0009 the run fence, 0010 reserved); this placeholder
-- keeps the numbers without a gap until it merges, and is deleted then.
SELECT 1;
