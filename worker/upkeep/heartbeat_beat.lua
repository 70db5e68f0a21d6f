-- A worker's heartbeat (worker/upkeep/heartbeat.py, Heartbeat.beat): one call per beat.
-- KEYS: the workers hash of each queue; ARGV: nodename, ttl_s, then one JSON entry per key.
-- Stamps the entries with Redis's clock, drops fields that expired, keeps the hash alive as
-- long as its longest-lived worker. Returns 1.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local ttl = tonumber(ARGV[2])
for i, key in ipairs(KEYS) do
  local entry = cjson.decode(ARGV[2 + i])
  entry['seen_at'] = now
  entry['expires_at'] = now + ttl
  redis.call('HSET', key, ARGV[1], cjson.encode(entry))
  local all = redis.call('HGETALL', key)
  for j = 1, #all, 2 do
    local ok, e = pcall(cjson.decode, all[j + 1])
    if not ok or type(e) ~= 'table' or (tonumber(e['expires_at']) or 0) <= now then
      redis.call('HDEL', key, all[j])
    end
  end
  if redis.call('TTL', key) < ttl + 1 then
    redis.call('EXPIRE', key, math.ceil(ttl) + 1)
  end
end
return 1
