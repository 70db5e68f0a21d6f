-- The live workers (worker/registry.py, WorkerRegistry.live): one call per read.
-- KEYS: the workers hash of each queue. Returns {now, entries of key 1, entries of key 2, ...}
-- with only the entries that have not expired. Read-only.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local out = {tostring(now)}
for i, key in ipairs(KEYS) do
  local all = redis.call('HGETALL', key)
  local live = {}
  for j = 1, #all, 2 do
    local ok, e = pcall(cjson.decode, all[j + 1])
    if ok and type(e) == 'table' and (tonumber(e['expires_at']) or 0) > now then
      table.insert(live, all[j + 1])
    end
  end
  out[i + 1] = live
end
return out
