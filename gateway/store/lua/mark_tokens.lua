-- Keep token marks for update mode (gateway/service/token_marks.py): the
-- digests hash's field 'tokens:<j>' holds the tokens of the input before
-- chunk j (up to a settled point) and the bytes after that point.
-- ARGV: now, first seq, the mark of `first` the new marks were counted from
-- ('' for seq 0: nothing comes before it), then pairs (content sha256 of chunk
-- j, mark of j + 1) for j = first, first + 1, ... A mark is written only while
-- every chunk it was counted from is still stored as it was, so no mark
-- outlives a replacement (replace.lua deletes the marks after the chunk).
-- Reply: {'kept', marks written, more}: more = 1 when every pair was written
-- and the next chunk is already here without the mark after it (it arrived
-- early): the caller counts it too.
if not redis.call('HGET', META, 'state') then return {'gone'} end
local first = tonumber(ARGV[2])
if first > 0 and redis.call('HGET', DIGESTS, 'tokens:' .. first) ~= ARGV[3] then return {'stale'} end
local written = 0
for i = 4, #ARGV - 1, 2 do
  local seq = first + written
  local record = redis.call('HGET', DIGESTS, seq)
  if not record or split_record(record) ~= ARGV[i] then break end
  redis.call('HSET', DIGESTS, 'tokens:' .. (seq + 1), ARGV[i + 1])
  written = written + 1
end
local after = first + written
local more = 0
if written * 2 == #ARGV - 3 and redis.call('HEXISTS', DIGESTS, after) == 1
    and redis.call('HEXISTS', DIGESTS, 'tokens:' .. (after + 1)) == 0 then
  more = 1
end
return {'kept', written, more}
