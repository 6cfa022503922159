-- Count a new session against one limit. KEYS[1]: a sorted set of session
-- ids scored by when they stop counting at the latest. ARGV: now, limit,
-- session id, score. Reply: 1 admitted, 0 over the limit.
local now, limit = server_now_ms(), tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if limit > 0 and redis.call('ZCARD', KEYS[1]) >= limit then return 0 end
redis.call('ZADD', KEYS[1], ARGV[4], ARGV[3])
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
redis.call('PEXPIREAT', KEYS[1], last[2])
return 1
