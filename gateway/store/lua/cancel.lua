-- Cancel (idempotent for cancelled sessions). ARGV: now, cancelled_json.
local now = tonumber(ARGV[1])
local state = redis.call('HGET', META, 'state')
if not state then return {'not_found'} end
if state == 'expired' then return {'expired'} end
if state == 'cancelled' then return {'accepted', state, state} end
if TERMINAL[state] then return {'closed', state} end
close_session(state, 'cancelled', now, ARGV[2])
return {'accepted', 'cancelled', state}
