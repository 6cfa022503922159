-- Fail a live session (engine error, lost input). ARGV: now, error_json,
-- replica and epoch of the lease the caller holds ('' for none: not fenced).
-- Reply: {'failed', before, identity} or {'gone', state, identity} when it
-- had already ended (identity set: see publish.lua) or the caller's lease was
-- taken over (no identity).
local now = server_now_ms()
local state = redis.call('HGET', META, 'state')
if not state or TERMINAL[state] then return ended_reply(state) end
if ARGV[3] ~= '' and not holds(ARGV[3], ARGV[4]) then return {'gone', state, ''} end
close_session(state, 'failed', now, ARGV[2])
return {'failed', state, redis.call('HGET', META, 'identity')}
