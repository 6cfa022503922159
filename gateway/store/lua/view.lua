-- The session's fields by name, plus its missing sequence ids.
-- ARGV: caller, '1' to include the stored result (only an ended session has
-- one: the voice answer's WAV makes it megabytes, so only /result asks),
-- then the names of the fields to read.
-- Reply: {values in the order asked, result or false, {missing ids}}, or {}
-- when unknown (to the caller).
if foreign(ARGV[1] or '') then return {} end
local state = redis.call('HGET', META, 'state')
if not state then return {} end
local names = {}
for i = 3, #ARGV do names[#names + 1] = ARGV[i] end
local result = false
if ARGV[2] == '1' and TERMINAL[state] then result = redis.call('HGET', META, 'result') end
return {redis.call('HMGET', META, unpack(names)), result, missing_ids()}
