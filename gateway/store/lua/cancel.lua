-- Cancel (idempotent for cancelled sessions). ARGV: now, cancelled_json, caller.
-- Reply: {'accepted', 'cancelled', state before, identity} or an error status;
-- a repeat names the identity too, so a retry frees the slots a first call
-- may have failed to free.
local now = server_now_ms()
local state = redis.call('HGET', META, 'state')
if not state or foreign(ARGV[3]) then return {'not_found'} end
if state == 'expired' then return {'expired'} end
if state == 'cancelled' then return {'accepted', state, state, redis.call('HGET', META, 'identity')} end
if TERMINAL[state] then return {'closed', state} end
close_session(state, 'cancelled', now, ARGV[2])
return {'accepted', 'cancelled', state, redis.call('HGET', META, 'identity')}
