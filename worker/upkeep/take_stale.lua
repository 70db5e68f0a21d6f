-- The queued sweep's removal of stale deliveries (worker/upkeep/queued.py, take_stale):
-- each delivery tag is removed from kombu's unacked hash and its unacked_index only if it is
-- still in the hash and its delivery time is still at or before the cutoff (or it has none),
-- so a delivery kombu restored, a worker acknowledged or took again meanwhile is left alone.
-- KEYS[1]: the unacked hash; KEYS[2]: the unacked_index sorted set.
-- ARGV[1]: the cutoff (Unix seconds); ARGV[2..]: delivery tags. Returns how many it removed.
local cutoff = tonumber(ARGV[1])
local n = 0
for i = 2, #ARGV do
  local tag = ARGV[i]
  if redis.call('HEXISTS', KEYS[1], tag) == 1 then
    local at = redis.call('ZSCORE', KEYS[2], tag)
    if not at or tonumber(at) <= cutoff then
      redis.call('HDEL', KEYS[1], tag)
      redis.call('ZREM', KEYS[2], tag)
      n = n + 1
    end
  end
end
return n
