-- Park idle streaming work: the owner gives up its lease and aborts its
-- engine request (freeing its KV cache); the session stays 'streaming' with
-- all its input, and its next input resumes it (lib.lua resume_if_parked).
-- ARGV: now, replica, epoch, the last input entry the owner has read.
-- Reply: {'parked'}, or {'busy'} when there is input the owner has not read
-- yet, the input is complete, or the lease is not the caller's.
local state = redis.call('HGET', META, 'state')
if state ~= 'streaming' or not holds(ARGV[2], ARGV[3]) then return {'busy'} end
local last = redis.call('XREVRANGE', INPUT, '+', '-', 'COUNT', 1)
local last_id = '0-0'
if last[1] then last_id = last[1][1] end
if last_id ~= ARGV[4] then return {'busy'} end
redis.call('HSET', META, 'parked', 1, 'owner', '', 'lease_until', 0,
  'computed_tokens', meta_num('input_tokens') or 0)
redis.call('HINCRBY', META, 'parks', 1)
return {'parked'}
