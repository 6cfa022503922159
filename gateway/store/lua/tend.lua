-- The tender's step for one session: expire it when idle, hand it to a
-- replica when its engine work has no live owner, or say when to look again.
-- ARGV: now, expired_json, incomplete_json, claimant ('' when the caller has
--       no engine capacity or is draining).
-- incomplete_json has the placeholder __MISSING__ for the missing ids.
-- Reply: {'expired'|'failed', before, identity} when it ended the session now,
--        {'claimed', state, epoch, lease_until} when the claimant now owns its
--        engine work,
--        {'alive', state, recheck_at} otherwise, {'gone'} once it has ended.
local now, claimant = server_now_ms(), ARGV[4]
local state = redis.call('HGET', META, 'state')
if not state or TERMINAL[state] then return {'gone'} end

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

-- streaming or generating: its engine work needs a live owner.
local lease_until = meta_num('lease_until') or 0
if redis.call('HGET', META, 'owner') ~= '' and lease_until > now then
  local recheck = lease_until
  if state == 'streaming' then recheck = math.min(recheck, meta_num('expires_at')) end
  return {'alive', state, recheck}
end
if claimant ~= '' then
  local epoch = claim(claimant, now)
  return {'claimed', state, epoch, meta_num('lease_until')}
end
-- Waiting for a replica with room: every tender looks again soon.
redis.call('HSET', META, 'owner', '')
return {'alive', state, now}
