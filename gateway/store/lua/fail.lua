-- Fail a live session (engine error, lost input). ARGV: now, error_json,
-- replica and epoch of the lease the caller holds ('' for none: not fenced).
-- Reply: {'failed', before, identity} or {'gone', state} when it had already
-- ended or the caller's lease was taken over.
local now = server_now_ms()
local state = redis.call('HGET', META, 'state')
if not state or TERMINAL[state] then return {'gone', state or ''} end
if ARGV[3] ~= '' and not holds(ARGV[3], ARGV[4]) then return {'gone', state} end
close_session(state, 'failed', now, ARGV[2])
return {'failed', state, redis.call('HGET', META, 'identity')}
