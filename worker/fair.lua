-- Fair share of code.run between users: every change to the fair-share state is one call of
-- this script (worker/fair.py, FairQueue, says what the keys hold). One script, the operation
-- named in its arguments (as dramatiq's Redis broker runs its dispatch.lua): the operations
-- share the release and its helpers, written once here.
--
-- KEYS: worker/fair.py's KEYS, in that order (the user lists are ARGV[1] .. user).
-- ARGV[1] the wait-list prefix, ARGV[2] the per-user cap (0: none), ARGV[3] FAIR_MIN_AHEAD,
-- ARGV[4] most runs to release, ARGV[5] the operation; the operation's own arguments follow.

local Q, WORKERS, USERS, CAPPED, JOBS, MSGS, HELD, HELD_N, COUNTS, CLOCK, BACKLOG = unpack(KEYS)
local WAIT = ARGV[1]
local CAP = tonumber(ARGV[2])
local MIN_AHEAD = tonumber(ARGV[3])
local MAX_RELEASE = tonumber(ARGV[4])
local OP = ARGV[5]
local FIRST = 6  -- the operation's first argument

local function clock()
  return tonumber(redis.call('GET', CLOCK) or '0')
end

local function held_by(user)
  return tonumber(redis.call('HGET', HELD_N, user) or '0')
end

local function at_cap(user)
  return CAP > 0 and held_by(user) >= CAP
end

-- the run slots of the live, serving workers of code.run (their heartbeats)
local function live_slots()
  local t = redis.call('TIME')
  local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
  local total = 0
  local all = redis.call('HGETALL', WORKERS)
  for j = 2, #all, 2 do
    local ok, e = pcall(cjson.decode, all[j])
    if ok and type(e) == 'table' and e['state'] == 'serving'
        and (tonumber(e['expires_at']) or 0) > now then
      total = total + (tonumber(e['slots']) or 0)
    end
  end
  return total
end

-- a run leaves its user's list (released or forgotten): the counts follow
local function unlisted(job, user)
  redis.call('HDEL', JOBS, job)
  redis.call('HDEL', MSGS, job)
  redis.call('RPOP', BACKLOG)
  if tonumber(redis.call('ZINCRBY', COUNTS, -1, user)) <= 0 then
    redis.call('ZREM', COUNTS, user)
  end
end

local ops = {}

-- Move waiting runs into code.run, in turns, while it has room. Returns the runs released.
function ops.release()
  if CAP <= 0 then  -- no cap (any more): parked users take their turns again
    local parked = redis.call('HGETALL', CAPPED)
    for j = 1, #parked, 2 do
      redis.call('ZADD', USERS, tonumber(parked[j + 1]), parked[j])
    end
    if #parked > 0 then redis.call('DEL', CAPPED) end
  end
  local room = math.max(MIN_AHEAD, live_slots()) - redis.call('LLEN', Q)
  if room > MAX_RELEASE then room = MAX_RELEASE end
  local n = 0
  while n < room do
    local top = redis.call('ZRANGE', USERS, 0, 0, 'WITHSCORES')
    if #top == 0 then break end
    local user, vt = top[1], tonumber(top[2])
    local list = WAIT .. user
    local job = redis.call('LPOP', list)
    if job then
      local msg = redis.call('HGET', MSGS, job)
      unlisted(job, user)
      if msg then
        redis.call('LPUSH', Q, msg)
        redis.call('HSET', HELD, job, user)
        redis.call('HINCRBY', HELD_N, user, 1)
        n = n + 1
      end
      redis.call('SET', CLOCK, vt)
    end
    if redis.call('LLEN', list) == 0 then
      redis.call('ZREM', USERS, user)
    elseif at_cap(user) then
      redis.call('ZREM', USERS, user)
      redis.call('HSET', CAPPED, user, vt + 1)
    else
      redis.call('ZADD', USERS, vt + 1, user)
    end
  end
  return n
end

-- Arguments: job id, user, the kombu message. Puts the run on its user's list, then
-- releases. Returns the runs released.
function ops.enqueue()
  local job, user, msg = ARGV[FIRST], ARGV[FIRST + 1], ARGV[FIRST + 2]
  -- once per job (waiting or released): kombu's publish retry may put one message twice
  if redis.call('HEXISTS', HELD, job) == 0 and redis.call('HSETNX', JOBS, job, user) == 1 then
    redis.call('HSET', MSGS, job, msg)
    redis.call('ZINCRBY', COUNTS, 1, user)
    redis.call('LPUSH', BACKLOG, '1')
    if redis.call('RPUSH', WAIT .. user, job) == 1 then
      if at_cap(user) then
        redis.call('HSET', CAPPED, user, clock())
      else
        redis.call('ZADD', USERS, clock(), user)
      end
    end
  end
  return ops.release()
end

-- Arguments: job ids whose job ended (their cap slot is free). Then releases. Returns the
-- runs released.
function ops.ended()
  for i = FIRST, #ARGV do
    local job = ARGV[i]
    local user = redis.call('HGET', HELD, job)
    if user then
      redis.call('HDEL', HELD, job)
      local left = redis.call('HINCRBY', HELD_N, user, -1)
      if left <= 0 then redis.call('HDEL', HELD_N, user); left = 0 end
      local parked = redis.call('HGET', CAPPED, user)
      if parked and (CAP <= 0 or left < CAP) then
        redis.call('HDEL', CAPPED, user)
        redis.call('ZADD', USERS, math.max(tonumber(parked), clock()), user)
      end
    end
  end
  return ops.release()
end

-- Arguments: job ids taken off their user's list (cancelled, ended while waiting). Returns
-- how many were on a list.
function ops.forget()
  local n = 0
  for i = FIRST, #ARGV do
    local job = ARGV[i]
    local user = redis.call('HGET', JOBS, job)
    if user then
      local list = WAIT .. user
      redis.call('LREM', list, 1, job)
      unlisted(job, user)
      if redis.call('LLEN', list) == 0 then
        redis.call('ZREM', USERS, user)
        redis.call('HDEL', CAPPED, user)
      end
      n = n + 1
    end
  end
  return n
end

-- Argument: job id. Returns {} when it is on no list, else {user, runs of the user ahead,
-- users whose turn comes first (-1: the user is at its cap), users waiting}. Read-only.
function ops.where()
  local job = ARGV[FIRST]
  local user = redis.call('HGET', JOBS, job)
  if not user then return {} end
  local pos = redis.call('LPOS', WAIT .. user, job) or 0
  local rank = redis.call('ZRANK', USERS, user)
  if not rank then rank = -1 end
  return {user, pos, rank, redis.call('ZCARD', USERS) + redis.call('HLEN', CAPPED)}
end

-- Argument: how many users to rank. Returns {runs waiting, users waiting, runs held, user,
-- waiting, held, user, waiting, held, ...} for the users with the most runs waiting.
-- Read-only.
function ops.stats()
  local top = redis.call('ZREVRANGE', COUNTS, 0, tonumber(ARGV[FIRST]) - 1, 'WITHSCORES')
  local out = {redis.call('HLEN', JOBS), redis.call('ZCARD', COUNTS), redis.call('HLEN', HELD)}
  for j = 1, #top, 2 do
    table.insert(out, top[j])
    table.insert(out, tonumber(top[j + 1]))
    table.insert(out, held_by(top[j]))
  end
  return out
end

local op = ops[OP]
if not op then
  return redis.error_reply('worker/fair.lua: no operation ' .. tostring(OP))
end
return op()
