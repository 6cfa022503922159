-- The session's meta hash plus its missing sequence ids. ARGV: caller.
-- Reply: {flat field/value list, {missing ids}} or {} when unknown (to the caller).
if foreign(ARGV[1] or '') then return {} end
local fields = redis.call('HGETALL', META)
if #fields == 0 then return {} end
return {fields, missing_ids()}
