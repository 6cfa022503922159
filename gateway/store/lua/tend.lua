-- The tender's step for one session: expire it when idle, say whether its
-- engine work waits for a replica, or say when to look again.
-- ARGV: now, expired_json, incomplete_json.
-- incomplete_json has the placeholder __MISSING__ for the missing ids.
-- Reply: {'expired'|'failed', before, identity} when it ended the session now,
--        {'waiting', state, look_again_at, arrived, last_input, computed} when
--        its engine work has no live owner (the tender ranks these and claims
--        with claim.lua), {'alive', state, recheck_at} otherwise,
--        {'gone', state, identity} once it has ended (the tender frees its
--        slots: a release that failed after the end is healed here).
local now = server_now_ms()
local state = redis.call('HGET', META, 'state')
if not state or TERMINAL[state] then return ended_reply(state) end

if state ~= 'generating' then
  local expires_at = meta_num('expires_at')
  if expires_at <= now then
    if meta_num('final_seq') ~= nil then
      -- The client said where input ends, but chunks never arrived: that is a
      -- failure the client must see with the ids, not a silent expiry.
      local missing = table.concat(missing_ids(), ',')
      close_session(state, 'failed', now, (string.gsub(ARGV[3], '__MISSING__', missing, 1)))
      return {'failed', state, redis.call('HGET', META, 'identity')}
    end
    close_session(state, 'expired', now, ARGV[2])
    return {'expired', state, redis.call('HGET', META, 'identity')}
  end
  if state == 'open' then return {'alive', state, expires_at} end
end

-- A parked session waits for input (or its expiry), not for a replica.
if parked() then return {'alive', state, meta_num('expires_at')} end

-- streaming or generating: its engine work needs a live owner.
local lease_until = meta_num('lease_until') or 0
if redis.call('HGET', META, 'owner') ~= '' and lease_until > now then
  local recheck = lease_until
  if state == 'streaming' then recheck = math.min(recheck, meta_num('expires_at')) end
  return {'alive', state, recheck}
end
-- Waiting for a replica with room: every tender looks again soon.
redis.call('HSET', META, 'owner', '')
return {'waiting', state, now, meta_num('created_at'), meta_num('expires_at') - meta_num('timeout_ms'),
  meta_num('computed_tokens') or 0}
