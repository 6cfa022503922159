-- Shared by every session script. KEYS are always the five keys of one
-- session (gateway.store.keys.SessionKeys order), so each script touches a
-- single cluster slot. TRANSITIONS / TERMINAL are generated from
-- gateway.sessions.states and pasted in front of this file.
local META, CHUNKS, DIGESTS, INPUT, OUTPUT = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]

local function num(value)
  if value == false or value == nil or value == '' then return nil end
  return tonumber(value)
end

local function meta_num(field)
  return num(redis.call('HGET', META, field))
end

-- Keys die after the session can no longer be used: the idle deadline (or
-- the generation budget) plus the time terminal results stay readable. The
-- chunks are the exception: only engine work reads them (its owner, or a new
-- owner rebuilding the engine session from them), and only while the session
-- runs. They go when it ends, and a live session's die with its deadline
-- (plus a lease's time, for a reader a moment behind), not a result's life
-- later: their bytes are what the session caps bound, and an ended session no
-- longer counts against any cap. The digests stay (dedupe of a retried chunk).
local function refresh_ttl(state, now)
  local keep = meta_num('result_ttl_ms')
  if TERMINAL[state] then
    redis.call('DEL', CHUNKS)
    for _, key in ipairs({META, DIGESTS, INPUT, OUTPUT}) do redis.call('PEXPIREAT', key, now + keep) end
    return
  end
  local live
  if state == 'generating' then
    live = now + meta_num('generation_ttl_ms')
  else
    live = meta_num('expires_at')
  end
  redis.call('PEXPIREAT', CHUNKS, live + (meta_num('lease_ttl_ms') or 0))
  for _, key in ipairs({META, DIGESTS, INPUT, OUTPUT}) do redis.call('PEXPIREAT', key, live + keep) end
end

-- Past its idle deadline a session takes no more input, even before a tender
-- has expired it (none may be running): its chunks may be gone already.
local function past_deadline(state, now)
  return (state == 'open' or state == 'streaming') and meta_num('expires_at') <= now
end

local function move(from, to, now)
  -- Callers check the state first; reaching this is a bug, so stop loudly.
  if not TRANSITIONS[from][to] then error('illegal transition ' .. from .. ' -> ' .. to) end
  redis.call('HSET', META, 'state', to, 'updated_at', now)
  -- An ended session has no engine work, so nobody owns it: the view must not
  -- name a replica that merely finished (or died just after finishing) it.
  if TERMINAL[to] then redis.call('HSET', META, 'owner', '', 'lease_until', 0) end
end

-- End a live session: state, reason, abort its engine work, tell subscribers.
local function close_session(from, to, now, error_json)
  move(from, to, now)
  if error_json then
    redis.call('HSET', META, 'error', error_json)
    redis.call('XADD', OUTPUT, '*', 'e', 'error', 'd', error_json, 't', '1')
  end
  redis.call('XADD', INPUT, '*', 'abort', to)
  refresh_ttl(to, now)
end

local function split_record(record)
  local digest, bytes, audio_ms, tokens = string.match(record, '^([^:]*):(%d+):(%d+):(%d+)$')
  return digest, tonumber(bytes), tonumber(audio_ms), tonumber(tokens)
end

local function early_start_due()
  if redis.call('HGET', META, 'start_early') ~= '1' then return false end
  local need_chunks = meta_num('start_chunks')
  local need_bytes = meta_num('start_bytes')
  local need_ms = meta_num('start_audio_ms')
  return (need_chunks > 0 and meta_num('contig_chunks') >= need_chunks)
      or (need_bytes > 0 and meta_num('contig_bytes') >= need_bytes)
      or (need_ms > 0 and meta_num('contig_audio_ms') >= need_ms)
end

-- Engine work is owned through a lease: owner, lease_until (ms) and an epoch
-- that grows with every claim. Writes on behalf of the engine work carry the
-- epoch, so a replica that lost its lease (paused, partitioned) is fenced off.
local function claim(replica, now)
  local epoch = redis.call('HINCRBY', META, 'lease_epoch', 1)
  redis.call('HSET', META, 'owner', replica, 'lease_until', now + meta_num('lease_ttl_ms'))
  return epoch
end

-- The lease check on fields already read (owner, lease_epoch as stored).
local function holds_as(owner, stored_epoch, replica, epoch)
  return replica ~= '' and owner == replica and num(stored_epoch) == tonumber(epoch)
end

local function holds(replica, epoch)
  return holds_as(redis.call('HGET', META, 'owner'), redis.call('HGET', META, 'lease_epoch'), replica, epoch)
end

local function runnable(state)
  return state == 'streaming' or state == 'generating'
end

-- A parked session (idle streaming work whose engine request was aborted to
-- free its KV cache) waits for input, not for a replica.
local function parked()
  return redis.call('HGET', META, 'parked') == '1'
end

-- New input for a parked session: its engine work is due again. The caller
-- takes it when it passes its id (it has room); otherwise any replica's
-- tender claims it. Returns the lease epoch taken, or 0.
local function resume_if_parked(replica, now)
  if not parked() then return 0 end
  redis.call('HSET', META, 'parked', 0)
  redis.call('HINCRBY', META, 'resumes', 1)
  if replica ~= '' then return claim(replica, now) end
  return 0
end

-- Hand every newly contiguous chunk to the owner's input stream, then open
-- the engine session if the start policy (or the end of input) says so.
-- Returns the state before, the state after, and 1 if engine work starts now.
local function advance(state, now, replica)
  local next_seq = meta_num('next_seq')
  local contig_chunks, contig_bytes, contig_ms =
    meta_num('contig_chunks'), meta_num('contig_bytes'), meta_num('contig_audio_ms')
  while true do
    local record = redis.call('HGET', DIGESTS, next_seq)
    if not record then break end
    local _, bytes, audio_ms = split_record(record)
    contig_chunks, contig_bytes, contig_ms = contig_chunks + 1, contig_bytes + bytes, contig_ms + audio_ms
    redis.call('XADD', INPUT, '*', 's', next_seq)
    next_seq = next_seq + 1
  end
  redis.call('HSET', META, 'next_seq', next_seq, 'contig_chunks', contig_chunks,
    'contig_bytes', contig_bytes, 'contig_audio_ms', contig_ms)

  local final_seq = meta_num('final_seq')
  local complete = final_seq ~= nil and next_seq > final_seq
  local started = 0
  local after = state
  if complete and (state == 'open' or state == 'streaming') then
    after = 'generating'
    redis.call('XADD', INPUT, '*', 'end', now)
    redis.call('HSET', META, 'input_done_at', now)
  elseif state == 'open' and early_start_due() then
    after = 'streaming'
  end
  local epoch = 0
  if after ~= state then
    move(state, after, now)
    if state == 'open' then
      started = 1
      redis.call('HSET', META, 'started_at', now)
      -- The replica whose call started the engine work takes it when it has
      -- room (it passes its id); otherwise the session waits, unowned, for
      -- any replica's tender to claim it.
      if replica ~= '' then epoch = claim(replica, now) end
    end
  end
  if runnable(after) then
    local resumed = resume_if_parked(replica, now)
    if resumed > 0 then epoch = resumed end
  end
  return state, after, started, next_seq, epoch
end

-- 2 in a reply's "started" field: engine work started earlier has no live
-- owner (the call that started it may have failed to schedule it, or its
-- owner died): the caller puts it back in the schedule, so a client's retry
-- (a duplicate) is enough to get it running again.
local function unowned(state, now)
  return runnable(state) and not parked() and (redis.call('HGET', META, 'owner') == ''
    or meta_num('lease_until') <= now)
end

local function started_flag(started, state, now)
  if started == 0 and unowned(state, now) then return 2 end
  return started
end

-- The reply of a script that found its session ended: {'gone', state,
-- identity}; state and identity '' when its keys are gone.
local function ended_reply(state)
  if not state then return {'gone', '', ''} end
  local identity = ''
  if TERMINAL[state] then identity = redis.call('HGET', META, 'identity') or '' end
  return {'gone', state, identity}
end

-- Sessions are visible only to the identity that created them; to anyone
-- else they do not exist (no existence leak). Internal callers pass ''.
local function foreign(caller)
  return caller ~= '' and redis.call('HGET', META, 'identity') ~= caller
end

local function touch(now)
  redis.call('HSET', META, 'expires_at', now + meta_num('timeout_ms'), 'updated_at', now)
end

-- One chunk into a live session. Returns the reply table of append.lua.
local function append_chunk(now, replica, seq, record, blob, eoi, too_large_json, caller)
  local state = redis.call('HGET', META, 'state')
  if not state or foreign(caller) then return {'not_found'} end
  if state == 'expired' then return {'expired'} end
  -- A completed session falls through: its input is closed, so retries of
  -- its chunks are duplicates and anything new is input_closed.
  if state == 'failed' or state == 'cancelled' then return {'closed', state} end
  if past_deadline(state, now) then return {'expired'} end

  local known = redis.call('HGET', DIGESTS, seq)
  if known then
    if split_record(known) == split_record(record) then
      return {'duplicate', state, state, started_flag(0, state, now), meta_num('next_seq'), 0}
    end
    return {'conflict'}
  end

  local final_seq = meta_num('final_seq')
  local max_seq = meta_num('max_seq')
  if final_seq ~= nil and (seq > final_seq or eoi == 1) then return {'input_closed', final_seq} end
  if eoi == 1 and seq < max_seq then return {'input_closed', max_seq} end
  local next_seq = meta_num('next_seq')
  if seq >= next_seq + meta_num('max_ooo') then return {'out_of_window', next_seq} end
  if meta_num('received') >= meta_num('max_chunks') then return {'too_many'} end

  local _, nbytes, _, ntokens = split_record(record)
  local total = meta_num('bytes') + nbytes
  if total > meta_num('max_bytes') then
    close_session(state, 'failed', now, too_large_json)
    return {'too_large', state, redis.call('HGET', META, 'identity')}
  end
  -- The model's context: refused before anything is stored; the session stays.
  local max_tokens = meta_num('max_input_tokens') or 0
  local tokens = (meta_num('input_tokens') or 0) + ntokens
  if max_tokens > 0 and tokens > max_tokens then return {'too_long', tokens, max_tokens} end

  redis.call('HSET', DIGESTS, seq, record)
  redis.call('HSET', CHUNKS, seq, blob)
  redis.call('HSET', META, 'bytes', total, 'received', meta_num('received') + 1,
    'max_seq', math.max(max_seq, seq), 'input_tokens', tokens)
  if eoi == 1 then redis.call('HSET', META, 'final_seq', seq) end

  local before, after, started, new_next, epoch = advance(state, now, replica)
  touch(now)
  refresh_ttl(after, now)
  return {'accepted', after, before, started_flag(started, after, now), new_next, epoch}
end

-- Sequence ids between the contiguous prefix and the highest id expected
-- that have not arrived (bounded by the ordering window).
local function missing_ids()
  local missing = {}
  local last = meta_num('final_seq') or meta_num('max_seq')
  for seq = meta_num('next_seq'), last do
    if redis.call('HEXISTS', DIGESTS, seq) == 0 then table.insert(missing, seq) end
  end
  return missing
end
