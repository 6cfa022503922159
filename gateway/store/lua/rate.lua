-- Token bucket of one identity. KEYS[1]: its hash. ARGV: now (ms), rate
-- (tokens/s), burst. Reply: 0 when a token was taken, else the ms to wait.
local now, rate, burst = server_now_ms(), tonumber(ARGV[2]), tonumber(ARGV[3])
local tokens = tonumber(redis.call('HGET', KEYS[1], 'tokens') or burst)
local last = tonumber(redis.call('HGET', KEYS[1], 'ts') or now)
tokens = math.min(burst, tokens + math.max(0, now - last) * rate / 1000)
local wait = 0
if tokens < 1 then
  wait = math.ceil((1 - tokens) * 1000 / rate)
else
  tokens = tokens - 1
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', now)
redis.call('PEXPIRE', KEYS[1], math.ceil(burst * 1000 / rate) + 1000)
return wait
