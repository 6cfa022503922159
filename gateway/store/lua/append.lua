-- Append one chunk. ARGV: now, replica, seq, record, blob, eoi, too_large_json, caller.
-- Reply: {status, state_after, state_before, started, next_seq, lease epoch (0: not
-- claimed by this call)} or {error status, ...}.
return append_chunk(server_now_ms(), ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5],
  tonumber(ARGV[6]), ARGV[7], ARGV[8])
