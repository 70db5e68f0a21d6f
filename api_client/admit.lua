-- An editor test call's admission, in ONE round trip, in Redis's own clock (so every API
-- process agrees). Run by api_client/client.py (CodeClient: the per-minute rate only) and
-- api_client/http/inflight.py (InFlight.admit: the HTTP route's slot of the user's waiting
-- calls, checked first, and the rate).
--
-- The rate (STUDIO_CODE_TEST_PER_MINUTE) is a sliding window: drop calls older than the
-- window, count the rest, admit and record this call only when under the limit; otherwise
-- say when the oldest call leaves the window. The waiting calls (STUDIO_CODE_TEST_IN_FLIGHT)
-- are a sorted set per user scored with the time each call gives up waiting: expired members
-- are dropped first, so a slot held by an API process that died frees itself.
--
-- KEYS[1] the user's rate key; KEYS[2] (the HTTP route only) the user's in-flight key.
-- ARGV[1] calls per window, ARGV[2] the window in microseconds, ARGV[3] the call's token;
-- with KEYS[2]: ARGV[4] waiting calls allowed, ARGV[5] how long this call waits, in ms.
-- Returns {1, 0}: admitted; {2, 0}: too many waiting; {0, us}: over the rate, a call is
-- admitted again in ``us``.
local rate_key, token = KEYS[1], ARGV[3]
local rate_limit, window_us = tonumber(ARGV[1]), tonumber(ARGV[2])
local key = KEYS[2]
local t = redis.call('TIME')
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

if key then
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  if redis.call('ZCARD', key) >= tonumber(ARGV[4]) then
    return {2, 0}
  end
end

redis.call('ZREMRANGEBYSCORE', rate_key, '-inf', now_us - window_us)
if redis.call('ZCARD', rate_key) >= rate_limit then
  local oldest = redis.call('ZRANGE', rate_key, 0, 0, 'WITHSCORES')
  return {0, tonumber(oldest[2]) + window_us - now_us}
end
redis.call('ZADD', rate_key, now_us, token)
redis.call('PEXPIRE', rate_key, math.floor(window_us / 1000) + 1000)

if key then
  redis.call('ZADD', key, now + tonumber(ARGV[5]), token)
  local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  redis.call('PEXPIRE', key, tonumber(last[2]) - now + 1000)
end
return {1, 0}
