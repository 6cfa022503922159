-- Append output frames of a generating session; optionally end it.
-- ARGV: now, terminal ('' | 'completed'), stored (the result JSON, when
--       terminal), then event/data/last triples. Failures go through fail.lua.
-- Reply: {'ok', id...} or {'gone', state} when the session is no longer generating.
local now, terminal, stored = tonumber(ARGV[1]), ARGV[2], ARGV[3]
local state = redis.call('HGET', META, 'state')
if state ~= 'generating' then return {'gone', state or ''} end
local reply = {'ok'}
for i = 4, #ARGV, 3 do
  table.insert(reply, redis.call('XADD', OUTPUT, '*', 'e', ARGV[i], 'd', ARGV[i + 1], 't', ARGV[i + 2]))
end
if terminal ~= '' then
  move(state, terminal, now)
  redis.call('HSET', META, 'result', stored)
  refresh_ttl(terminal, now)
end
return reply
