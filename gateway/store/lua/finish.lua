-- End of input (idempotent). ARGV: now, replica, final_sequence_id or '', caller.
-- Reply: {status, state_after, state_before, started, next_seq, lease epoch, missing...}.
local now, replica, asked = server_now_ms(), ARGV[2], num(ARGV[3])
local state = redis.call('HGET', META, 'state')
if not state or foreign(ARGV[4]) then return {'not_found'} end
if state == 'expired' then return {'expired'} end
if state == 'failed' or state == 'cancelled' then return {'closed', state} end
if past_deadline(state, now) then return {'expired'} end

local final_seq = meta_num('final_seq')
if asked ~= nil and final_seq ~= nil and asked ~= final_seq then return {'input_closed', final_seq} end
if state == 'generating' or state == 'completed' then
  return {'accepted', state, state, started_flag(0, state, now), meta_num('next_seq'), 0}
end

if final_seq == nil then
  local max_seq, next_seq = meta_num('max_seq'), meta_num('next_seq')
  if asked == nil then
    if max_seq < 0 then return {'empty'} end
    asked = max_seq
  end
  if asked < max_seq then return {'below_received', max_seq} end
  if asked >= next_seq + meta_num('max_ooo') then return {'out_of_window', next_seq} end
  redis.call('HSET', META, 'final_seq', asked)
end
local before, after, started, next_seq, epoch = advance(state, now, replica)
touch(now)
refresh_ttl(after, now)
local reply = {'accepted', after, before, started_flag(started, after, now), next_seq, epoch}
for _, seq in ipairs(missing_ids()) do table.insert(reply, seq) end
return reply
