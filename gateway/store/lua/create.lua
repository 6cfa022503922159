-- Create a session, optionally with its first chunk, in one step.
-- ARGV: now, replica, has_chunk, seq, record, blob, eoi, too_large_json,
--       then field/value pairs for the meta hash.
local now, replica = server_now_ms(), ARGV[2]
if redis.call('EXISTS', META) == 1 then return {'exists'} end
local fields = {}
for i = 9, #ARGV do table.insert(fields, ARGV[i]) end
redis.call('HSET', META, unpack(fields))
touch(now)
if ARGV[3] == '1' then
  local reply = append_chunk(now, replica, tonumber(ARGV[4]), ARGV[5], ARGV[6], tonumber(ARGV[7]), ARGV[8], '')
  -- A first chunk that cannot be taken leaves no session behind.
  if reply[1] ~= 'accepted' then
    for i = 1, 5 do redis.call('DEL', KEYS[i]) end
  end
  return reply
end
refresh_ttl('open', now)
return {'accepted', 'open', 'open', 0, 0, 0}
