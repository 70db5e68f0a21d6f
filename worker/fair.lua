-- Fair share of code.run between share keys, and caps per key: every change to the
-- fair-share state is one call of this script (worker/fair.py, FairQueue, says what the keys
-- hold). One script, the operation named in its arguments (as dramatiq's Redis broker runs
-- its dispatch.lua): the operations share the release and its helpers, written once here.
--
-- A run waits on a lane: the list of its (tenant, user, workflow), named by the user alone
-- when it has neither tenant nor workflow, else by the JSON array ["tenant","user","workflow"].
-- Lanes belong to a flow, the run's share key (ARGV[6]: the user, the tenant, or both); flows
-- take turns (start-time fair queueing over USERS), and a flow's lanes go oldest head first,
-- so a flow's runs leave in the order they came except past a lane held at a cap. A lane is
-- held when one of its keys (u:<user>, t:<tenant>, w:<tenant>/<workflow>) has as many runs
-- released and not ended as that kind's cap: it is parked on that key until a run of the key
-- ends; a flow whose every lane is parked is parked itself (CAPPED) with its virtual time.
--
-- KEYS: worker/fair.py's KEYS, in that order (the lane lists are ARGV[1] .. lane).
-- ARGV[1] the wait-list prefix, ARGV[2] the per-user cap (0: none), ARGV[3] FAIR_MIN_AHEAD,
-- ARGV[4] most runs to release, ARGV[5] the operation, ARGV[6] the share key (user, tenant,
-- tenant/user), ARGV[7] the per-tenant cap, ARGV[8] the per-workflow cap, ARGV[9] the prefix
-- of the other per-flow and per-key keys; the operation's own arguments follow.

local Q, WORKERS, USERS, CAPPED, JOBS, MSGS, HELD, HELD_N, COUNTS, CLOCK, BACKLOG, SEQ,
  PARKED, PARKED_KINDS, SEQ_NEXT, AGAIN = unpack(KEYS)
local WAIT = ARGV[1]
local CAPS = {u = tonumber(ARGV[2]), t = tonumber(ARGV[7]), w = tonumber(ARGV[8])}
local MIN_AHEAD = tonumber(ARGV[3])
local MAX_RELEASE = tonumber(ARGV[4])
local OP = ARGV[5]
local SHARE = ARGV[6]
local LANES = ARGV[9] .. 'lanes:'    -- ZSET per flow: lane -> sequence of its head run
local PARKED_ON = ARGV[9] .. 'parked:' -- ZSET per key: lanes parked on it -> head sequence
local FIRST = 10  -- the operation's first argument

local function clock()
  return tonumber(redis.call('GET', CLOCK) or '0')
end

-- the lane's tenant, user and workflow
local function parts(lane)
  if string.sub(lane, 1, 1) == '[' then
    local ok, t = pcall(cjson.decode, lane)
    if ok and type(t) == 'table' and #t == 3 then return t[1], t[2], t[3] end
  end
  return '', lane, ''
end

-- the lane's flow under the share key
local function flow_of(lane)
  local tenant, user = parts(lane)
  if tenant == '' or SHARE == 'user' then return user end
  if SHARE == 'tenant' then return 'tenant:' .. tenant end
  return 'tenant:' .. tenant .. '/' .. user
end

-- the lane's capped keys, most specific first: {kind, key}
local function keys_of(lane)
  local tenant, user, workflow = parts(lane)
  local out = {}
  if workflow ~= '' then table.insert(out, {'w', 'w:' .. tenant .. '/' .. workflow}) end
  table.insert(out, {'u', 'u:' .. user})
  if tenant ~= '' then table.insert(out, {'t', 't:' .. tenant}) end
  return out
end

local function held_by(key)
  return tonumber(redis.call('HGET', HELD_N, key) or '0')
end

-- the first of the lane's keys at its kind's cap: kind, key (nil: none)
local function blocker(lane)
  for _, k in ipairs(keys_of(lane)) do
    local cap = CAPS[k[1]]
    if cap > 0 and held_by(k[2]) >= cap then return k[1], k[2] end
  end
  return nil
end

local function head_seq(lane)
  local job = redis.call('LINDEX', WAIT .. lane, 0)
  if not job then return nil end
  return tonumber(redis.call('HGET', SEQ, job) or '0')
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

-- a run leaves its lane (released or forgotten): the counts follow
local function unlisted(job, flow)
  redis.call('HDEL', JOBS, job)
  redis.call('HDEL', MSGS, job)
  redis.call('HDEL', SEQ, job)
  redis.call('RPOP', BACKLOG)
  if tonumber(redis.call('ZINCRBY', COUNTS, -1, flow)) <= 0 then
    redis.call('ZREM', COUNTS, flow)
  end
end

-- the flow takes turns again (it had none, or was parked: its virtual time is kept)
local function wake(flow)
  if redis.call('ZSCORE', USERS, flow) then return end
  local parked = redis.call('HGET', CAPPED, flow)
  local vt = clock()
  if parked then
    redis.call('HDEL', CAPPED, flow)
    vt = math.max(tonumber(parked), vt)
  end
  redis.call('ZADD', USERS, vt, flow)
end

-- the flow has no lane to take from: parked while it has runs waiting, else gone
local function rest(flow, vt)
  redis.call('ZREM', USERS, flow)
  if tonumber(redis.call('ZSCORE', COUNTS, flow) or '0') > 0 then
    redis.call('HSET', CAPPED, flow, vt)
  else
    redis.call('HDEL', CAPPED, flow)
  end
end

local function park(lane, kind, key, flow)
  local seq = head_seq(lane) or 0
  redis.call('ZREM', LANES .. flow, lane)
  redis.call('HSET', PARKED, lane, key)
  redis.call('ZADD', PARKED_ON .. key, seq, lane)
  redis.call('HINCRBY', PARKED_KINDS, kind, 1)
end

-- a parked lane leaves its key's list (to take turns again, or emptied)
local function unpark(lane)
  local key = redis.call('HGET', PARKED, lane)
  if not key then return end
  redis.call('HDEL', PARKED, lane)
  redis.call('ZREM', PARKED_ON .. key, lane)
  if redis.call('HINCRBY', PARKED_KINDS, string.sub(key, 1, 1), -1) <= 0 then
    redis.call('HDEL', PARKED_KINDS, string.sub(key, 1, 1))
  end
end

-- every lane parked on ``key`` takes turns again (the first pick parks again any still held)
local function free(key)
  local lanes = redis.call('ZRANGE', PARKED_ON .. key, 0, -1, 'WITHSCORES')
  for j = 1, #lanes, 2 do
    local lane = lanes[j]
    unpark(lane)
    if redis.call('LLEN', WAIT .. lane) > 0 then
      local flow = flow_of(lane)
      redis.call('ZADD', LANES .. flow, tonumber(lanes[j + 1]), lane)
      wake(flow)
    end
  end
end

local ops = {}

-- Move waiting runs into code.run, in turns, while it has room. Returns the runs released.
function ops.release()
  for kind, cap in pairs(CAPS) do  -- no cap of a kind (any more): its parked lanes go again
    if cap <= 0 and redis.call('HEXISTS', PARKED_KINDS, kind) == 1 then
      local parked = redis.call('HGETALL', PARKED)
      for j = 1, #parked, 2 do
        if string.sub(parked[j + 1], 1, 1) == kind then free(parked[j + 1]) end
      end
    end
  end
  local room = math.max(MIN_AHEAD, live_slots()) - redis.call('LLEN', Q)
  if room > MAX_RELEASE then room = MAX_RELEASE end
  local n = 0
  while n < room do
    local top = redis.call('ZRANGE', USERS, 0, 0, 'WITHSCORES')
    if #top == 0 then break end
    local flow, vt = top[1], tonumber(top[2])
    local lanes = LANES .. flow
    local lane = nil
    while true do  -- the flow's oldest lane no cap holds (held ones are parked)
      local first = redis.call('ZRANGE', lanes, 0, 0)
      if #first == 0 then break end
      if redis.call('LLEN', WAIT .. first[1]) == 0 then
        redis.call('ZREM', lanes, first[1])
      else
        local kind, key = blocker(first[1])
        if not kind then lane = first[1]; break end
        park(first[1], kind, key, flow)
      end
    end
    if not lane then
      rest(flow, vt)
    else
      local list = WAIT .. lane
      local job = redis.call('LPOP', list)
      local msg = redis.call('HGET', MSGS, job)
      unlisted(job, flow)
      if msg then
        redis.call('LPUSH', Q, msg)
        redis.call('HSET', HELD, job, lane)
        for _, k in ipairs(keys_of(lane)) do redis.call('HINCRBY', HELD_N, k[2], 1) end
        redis.call('HINCRBY', HELD_N, 'f:' .. flow, 1)
        n = n + 1
      end
      redis.call('SET', CLOCK, vt)
      local seq = head_seq(lane)
      if seq then
        redis.call('ZADD', lanes, seq, lane)
      else
        redis.call('ZREM', lanes, lane)
      end
      if redis.call('ZCARD', lanes) == 0 then
        rest(flow, vt + 1)
      else
        redis.call('ZADD', USERS, vt + 1, flow)
      end
    end
  end
  return n
end

-- the run goes on its lane, once per job (waiting or released): kombu's publish retry may
-- put one message twice
local function admit(job, lane, msg)
  if redis.call('HEXISTS', HELD, job) == 0 and redis.call('HSETNX', JOBS, job, lane) == 1 then
    local flow = flow_of(lane)
    local seq = redis.call('INCR', SEQ_NEXT)
    redis.call('HSET', SEQ, job, seq)
    redis.call('HSET', MSGS, job, msg)
    redis.call('ZINCRBY', COUNTS, 1, flow)
    redis.call('LPUSH', BACKLOG, '1')
    if redis.call('RPUSH', WAIT .. lane, job) == 1 then
      unpark(lane)  -- a stale entry (none is expected: an emptied lane leaves)
      redis.call('ZADD', LANES .. flow, seq, lane)
      wake(flow)
    end
  end
end

-- Arguments: job id, lane, the kombu message. Puts the run on its lane, then releases.
-- Returns the runs released.
function ops.enqueue()
  admit(ARGV[FIRST], ARGV[FIRST + 1], ARGV[FIRST + 2])
  return ops.release()
end

-- Arguments: job id, lane (its keys as the run store holds them), the kombu message. A
-- message the workers send again for a job that was sent before: a retry's next attempt
-- (worker.upkeep.retry_due) or a lost message (worker.upkeep.queued). A job released and
-- not ended (HELD: its message was lost after its release) holds its slot: the message
-- goes straight to code.run, the slot counted once. A job waiting on its lane has its
-- message there: nothing. Any other waits on its lane as a new run does: the lane its last
-- attempt had (AGAIN, kept by ``pause``), else the one given. Then releases. Returns the
-- runs released.
function ops.again()
  local job, lane, msg = ARGV[FIRST], ARGV[FIRST + 1], ARGV[FIRST + 2]
  if redis.call('HEXISTS', HELD, job) == 1 then
    redis.call('LPUSH', Q, msg)
  elseif redis.call('HEXISTS', JOBS, job) == 0 then
    lane = redis.call('HGET', AGAIN, job) or lane
    redis.call('HDEL', AGAIN, job)
    admit(job, lane, msg)
  end
  return ops.release()
end

-- the job's keys' slots are free (it was released and has not ended before): its lane, or
-- nil when it holds none
local function end_one(job)
  local lane = redis.call('HGET', HELD, job)
  if not lane then return nil end
  redis.call('HDEL', HELD, job)
  local keys = keys_of(lane)
  table.insert(keys, {'f', 'f:' .. flow_of(lane)})
  for _, k in ipairs(keys) do
    local left = redis.call('HINCRBY', HELD_N, k[2], -1)
    if left <= 0 then redis.call('HDEL', HELD_N, k[2]); left = 0 end
    if k[1] ~= 'f' and (CAPS[k[1]] <= 0 or left < CAPS[k[1]]) then free(k[2]) end
  end
  return lane
end

-- Arguments: job ids whose job ended (their keys' slots are free). Then releases. Returns
-- the runs released.
function ops.ended()
  for i = FIRST, #ARGV do end_one(ARGV[i]) end
  return ops.release()
end

-- Arguments: job ids whose attempt ended and whose next attempt waits out a retry's delay
-- (worker.job.retries): their slots are free as at an end, and their lane is kept (AGAIN)
-- for the next attempt's message (``again``). Then releases. Returns the runs released.
function ops.pause()
  for i = FIRST, #ARGV do
    local lane = end_one(ARGV[i])
    if lane then redis.call('HSET', AGAIN, ARGV[i], lane) end
  end
  return ops.release()
end

-- Arguments: job ids taken off their lane (cancelled, ended while waiting; their lane kept
-- for a next attempt goes too). Returns how many were on a lane.
function ops.forget()
  local n = 0
  for i = FIRST, #ARGV do
    local job = ARGV[i]
    redis.call('HDEL', AGAIN, job)  -- ended while waiting out a retry's delay
    local lane = redis.call('HGET', JOBS, job)
    if lane then
      local flow = flow_of(lane)
      local list = WAIT .. lane
      redis.call('LREM', list, 1, job)
      unlisted(job, flow)
      local seq = head_seq(lane)
      if seq then  -- its head may have changed: re-scored where it is
        redis.call('ZADD', LANES .. flow, 'XX', seq, lane)
        local key = redis.call('HGET', PARKED, lane)
        if key then redis.call('ZADD', PARKED_ON .. key, 'XX', seq, lane) end
      else
        redis.call('ZREM', LANES .. flow, lane)
        unpark(lane)
        if redis.call('ZCARD', LANES .. flow) == 0 then
          local parked = redis.call('HGET', CAPPED, flow)
          if tonumber(redis.call('ZSCORE', COUNTS, flow) or '0') <= 0 then
            redis.call('ZREM', USERS, flow)
            redis.call('HDEL', CAPPED, flow)
          elseif not parked and redis.call('ZSCORE', USERS, flow) then
            rest(flow, tonumber(redis.call('ZSCORE', USERS, flow)))
          end
        end
      end
      n = n + 1
    end
  end
  return n
end

-- Argument: job id. Returns {} when it is on no lane, else {flow, runs of its lane ahead,
-- flows whose turn comes first (-1: the flow is parked), flows waiting, the kind of the key
-- at its cap that holds the lane ('' none), that cap, that key's runs released}. Read-only.
function ops.where()
  local job = ARGV[FIRST]
  local lane = redis.call('HGET', JOBS, job)
  if not lane then return {} end
  local flow = flow_of(lane)
  local pos = redis.call('LPOS', WAIT .. lane, job) or 0
  local rank = redis.call('ZRANK', USERS, flow)
  if not rank then rank = -1 end
  local kind, key = blocker(lane)
  local cap, held = 0, 0
  if kind then cap, held = CAPS[kind], held_by(key) else kind = '' end
  return {flow, pos, rank, redis.call('ZCARD', USERS) + redis.call('HLEN', CAPPED), kind, cap,
    held}
end

-- Argument: how many flows to rank. Returns {runs waiting, flows waiting, runs held, flow,
-- waiting, held, flow, waiting, held, ...} for the flows with the most runs waiting.
-- Read-only.
function ops.stats()
  local top = redis.call('ZREVRANGE', COUNTS, 0, tonumber(ARGV[FIRST]) - 1, 'WITHSCORES')
  local out = {redis.call('HLEN', JOBS), redis.call('ZCARD', COUNTS), redis.call('HLEN', HELD)}
  for j = 1, #top, 2 do
    table.insert(out, top[j])
    table.insert(out, tonumber(top[j + 1]))
    table.insert(out, held_by('f:' .. top[j]))
  end
  return out
end

local op = ops[OP]
if not op then
  return redis.error_reply('worker/fair.lua: no operation ' .. tostring(OP))
end
return op()
