-- Renew the lease on a session's engine work. ARGV: now, replica, epoch.
-- Reply: {'ok', lease_until} or {'lost', state} when the lease is someone
-- else's now, or the session has ended.
local now = server_now_ms()
local state = redis.call('HGET', META, 'state')
if not state or not runnable(state) or not holds(ARGV[2], ARGV[3]) then return {'lost', state or ''} end
local lease_until = now + meta_num('lease_ttl_ms')
redis.call('HSET', META, 'lease_until', lease_until)
return {'ok', lease_until}
