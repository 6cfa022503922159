-- The session's meta hash plus its missing sequence ids.
-- Reply: {flat field/value list, {missing ids}} or {} when unknown.
local fields = redis.call('HGETALL', META)
if #fields == 0 then return {} end
return {fields, missing_ids()}
