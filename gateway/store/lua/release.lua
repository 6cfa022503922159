-- Give up the lease on a session's engine work (shutdown) so another replica
-- takes it at once. ARGV: replica, epoch. Reply: {'released'} or {'lost'}.
local state = redis.call('HGET', META, 'state')
if not state or not runnable(state) or not holds(ARGV[1], ARGV[2]) then return {'lost'} end
redis.call('HSET', META, 'owner', '', 'lease_until', 0)
return {'released'}
