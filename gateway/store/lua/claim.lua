-- Take a waiting session's engine work (the tender chose it). ARGV: now, replica.
-- Reply: {'claimed', state, epoch, lease_until}, or {'taken'} when it is no
-- longer waiting (another replica was quicker, it was parked, or it ended).
local now = server_now_ms()
local state = redis.call('HGET', META, 'state')
if not state or not runnable(state) or parked() then return {'taken'} end
if redis.call('HGET', META, 'owner') ~= '' and meta_num('lease_until') > now then return {'taken'} end
local epoch = claim(ARGV[2], now)
return {'claimed', state, epoch, meta_num('lease_until')}
