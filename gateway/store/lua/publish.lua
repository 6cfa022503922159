-- Append output frames of a session whose engine work runs (streaming: the
-- input transcript as it grows; generating: the answer); optionally end it.
-- ARGV: now, replica, epoch, first (index of the first frame in the session's
--       output), terminal ('' | 'completed'), stored (the result JSON, when
--       terminal), then event/data/last triples. Failures go through fail.lua.
-- Frames with an index already written are skipped, so a retry after a lost
-- reply never repeats one.
-- The stream gets the session's TTL with its first frame: without one it
-- would outlive every other key of a session whose holder died mid-answer.
-- Reply: {'ok', id...} or {'gone', state, identity} when the session is no
-- longer generating or the caller no longer holds its lease (an ended
-- session's identity: the caller frees its slots again, which is harmless if
-- they were, and heals a release that failed after the session ended).
local now, first, terminal, stored = server_now_ms(), tonumber(ARGV[4]), ARGV[5], ARGV[6]
-- One read of the four fields a publish checks (it runs for every delta): four
-- HGETs each time were most of the Redis commands a relayed token cost.
local state, owner, epoch, written = unpack(redis.call('HMGET', META, 'state', 'owner', 'lease_epoch', 'out_frames'))
if not runnable(state) or not holds_as(owner, epoch, ARGV[2], ARGV[3]) then return ended_reply(state) end
written = num(written) or 0
local reply = {'ok'}
local index = first
for i = 7, #ARGV, 3 do
  if index >= written then
    table.insert(reply, redis.call('XADD', OUTPUT, '*', 'e', ARGV[i], 'd', ARGV[i + 1], 't', ARGV[i + 2]))
    -- The recognized spoken input is part of the session (view and result).
    if ARGV[i] == 'transcript' then redis.call('HSET', META, 'input_transcript', ARGV[i + 1]) end
  end
  index = index + 1
end
redis.call('HSET', META, 'out_frames', math.max(written, index))
if written == 0 and terminal == '' then refresh_ttl(state, now) end
if terminal ~= '' then
  move(state, terminal, now)
  redis.call('HSET', META, 'result', stored)
  refresh_ttl(terminal, now)
end
return reply
