-- Reaper step for one session. ARGV: now, expired_json, incomplete_json.
-- incomplete_json has the placeholder __MISSING__ for the missing ids.
-- Reply: {'expired'|'failed', before, identity} when it ended the session now,
--        {'alive', state, recheck_at} when it is not due, {'gone'} otherwise.
local now = tonumber(ARGV[1])
local state = redis.call('HGET', META, 'state')
if not state or TERMINAL[state] then return {'gone'} end
if state == 'generating' then
  -- Not idle: the engine is answering. Look again after one timeout.
  return {'alive', state, now + meta_num('timeout_ms')}
end
local expires_at = meta_num('expires_at')
if expires_at > now then return {'alive', state, expires_at} end
if meta_num('final_seq') ~= nil then
  -- The client said where input ends, but chunks never arrived: that is a
  -- failure the client must see with the ids, not a silent expiry.
  local missing = table.concat(missing_ids(), ',')
  close_session(state, 'failed', now, (string.gsub(ARGV[3], '__MISSING__', missing, 1)))
  return {'failed', state, redis.call('HGET', META, 'identity')}
end
close_session(state, 'expired', now, ARGV[2])
return {'expired', state, redis.call('HGET', META, 'identity')}
