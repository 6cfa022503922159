-- Fail a live session (engine error, lost input). ARGV: now, error_json.
-- Reply: {'failed', before} or {'gone', state} when it had already ended.
local now = tonumber(ARGV[1])
local state = redis.call('HGET', META, 'state')
if not state or TERMINAL[state] then return {'gone', state or ''} end
close_session(state, 'failed', now, ARGV[2])
return {'failed', state, redis.call('HGET', META, 'identity')}
