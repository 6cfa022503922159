-- Replace a chunk already received (update mode). ARGV: now, replica, seq,
-- record, blob, caller, kept_tokens (of the input, unchanged by this).
-- Reply: {'replaced'|'unchanged', state, state, started, next_seq, lease epoch}
-- or a refusal: not_found, expired, closed, input_closed (the input is
-- complete: its answer is under way), unknown (no such chunk yet: send it
-- with an append), too_long, over_cap.
local now, replica, seq, record = server_now_ms(), ARGV[2], tonumber(ARGV[3]), ARGV[4]
local state = redis.call('HGET', META, 'state')
if not state or foreign(ARGV[6]) then return {'not_found'} end
if state == 'expired' then return {'expired'} end
if state == 'failed' or state == 'cancelled' then return {'closed', state} end
if past_deadline(state, now) then return {'expired'} end
local next_seq = meta_num('next_seq')
if state ~= 'open' and state ~= 'streaming' then return {'input_closed', meta_num('final_seq') or next_seq - 1} end
local known = redis.call('HGET', DIGESTS, seq)
if not known then return {'unknown', next_seq} end
if split_record(known) == split_record(record) then
  return {'unchanged', state, state, started_flag(0, state, now), next_seq, 0}
end

-- The caps, with the old chunk's share taken out.
local _, old_bytes, old_ms, old_tokens = split_record(known)
local _, new_bytes, new_ms, new_tokens = split_record(record)
local total = meta_num('bytes') - old_bytes + new_bytes
if total > meta_num('max_bytes') then return {'over_cap', meta_num('max_bytes')} end
local tokens = (meta_num('input_tokens') or 0) - old_tokens + new_tokens
local max_tokens = meta_num('max_input_tokens') or 0
if max_tokens > 0 and tokens > max_tokens then return {'too_long', tokens, max_tokens} end

redis.call('HSET', DIGESTS, seq, record)
redis.call('HSET', CHUNKS, seq, ARGV[5])
-- Token marks after this chunk were counted with its old text (mark_tokens.lua).
for later = seq + 1, meta_num('max_seq') + 1 do redis.call('HDEL', DIGESTS, 'tokens:' .. later) end
redis.call('HSET', META, 'bytes', total, 'input_tokens', tokens)
local replaced = redis.call('HINCRBY', META, 'replaced', 1)
local epoch = 0
if seq < next_seq then
  redis.call('HSET', META, 'contig_bytes', meta_num('contig_bytes') - old_bytes + new_bytes,
    'contig_audio_ms', meta_num('contig_audio_ms') - old_ms + new_ms)
  if state == 'streaming' then
    -- The engine took in the old chunk: its owner restarts the engine
    -- request from Redis (the prefix cache keeps the unchanged prefix).
    redis.call('XADD', INPUT, '*', 'restart', replaced)
    redis.call('HSET', META, 'computed_tokens', math.min(meta_num('computed_tokens') or 0, tonumber(ARGV[7])))
    epoch = resume_if_parked(replica, now)
  end
end
touch(now)
refresh_ttl(state, now)
return {'replaced', state, state, started_flag(0, state, now), next_seq, epoch}
