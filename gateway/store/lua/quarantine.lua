-- A due session whose own script failed (a corrupted hash, a bug it alone
-- trips): look at it again later, and after too many failures take it out
-- of the schedule for good, into the dead letters, so it never again stands
-- first in every tender's round. KEYS: the schedule, its failure counts,
-- the dead letters (one slot: their hash tag is the schedule's name).
-- ARGV: session id, failures allowed, first back-off (ms), error text.
-- Reply: {'retry', failures, due_at} or {'dead', failures}.
local now = server_now_ms()
local sid, allowed, backoff = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
-- Another tender, whose round read the session as due too, set it aside
-- already: it stays out (a new count here would put it back for good).
if redis.call('HEXISTS', KEYS[3], sid) == 1 then
  return {'dead', allowed}
end
local failures = redis.call('HINCRBY', KEYS[2], sid, 1)
redis.call('PEXPIRE', KEYS[2], 86400000)
if failures >= allowed then
  redis.call('ZREM', KEYS[1], sid)
  redis.call('HDEL', KEYS[2], sid)
  redis.call('HSET', KEYS[3], sid, ARGV[4])
  return {'dead', failures}
end
local due = now + backoff * 2 ^ (failures - 1)
-- XX: a session taken out of the schedule meanwhile (ended) is not put back.
redis.call('ZADD', KEYS[1], 'XX', due, sid)
return {'retry', failures, due}
