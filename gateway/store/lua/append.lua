-- Append one chunk. ARGV: now, replica, seq, record, blob, eoi, too_large_json, caller.
-- Reply: {status, state_after, state_before, started, next_seq, lease epoch (0: not
-- claimed by this call), token mark of seq (accepted only; nil without one: see
-- mark_tokens.lua)} or {error status, ...}.
local reply = append_chunk(server_now_ms(), ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5],
  tonumber(ARGV[6]), ARGV[7], ARGV[8])
if reply[1] == 'accepted' then reply[7] = redis.call('HGET', DIGESTS, 'tokens:' .. ARGV[3]) end
return reply
