-- Re-score one schedule entry only if nobody changed it since the tender read
-- it: an append that made the session "due now" meanwhile must win over the
-- tender's later "look again at lease_until". KEYS[1]: the schedule.
-- ARGV: member, score the tender read, new score ('' to remove).
local current = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not current or tonumber(current) ~= tonumber(ARGV[2]) then return 0 end
if ARGV[3] == '' then
  redis.call('ZREM', KEYS[1], ARGV[1])
else
  redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
end
return 1
