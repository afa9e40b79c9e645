-- record.lua: deliver or buffer one batch of layer signals of one instance and rank.
--
-- KEYS[1] live     hash  slot -> "request_id|lease_deadline_ms" of the slot's task
-- KEYS[2] pending  hash  slot -> packed pending records (see _lib.lua)
-- KEYS[3] expiry   zset  slot group -> earliest pending deadline of the group (see _lib.lua)
-- KEYS[4] stats    hash  counters (no TTL)
-- KEYS[5] reply    string, this call's idempotency token: the reply, kept reply_ttl_ms
-- ARGV[1] now_ms (empty: server TIME)      ARGV[2] layer
-- ARGV[3] pending_ttl_ms                   ARGV[4] pending key TTL in ms (pending_ttl + grace)
-- ARGV[5] reply_ttl_ms                     ARGV[6] sweep limit (slots per run)
-- ARGV[7] entries, packed "slot,tokens,request_id;" (request_id empty when unknown)
--
-- Reply: "ok|<now_ms>|<flags>", one flag per entry in order: D delivered (the slot has a live
-- task of this request, or of any request when the signal carries none), B buffered.
--
-- Guarantees: the liveness check and the buffering happen in this one script, so a signal is
-- either delivered here or buffered, never both and never neither. A resend with the same
-- token returns the first reply and writes nothing new. One HMGET of live, and for buffered
-- entries one HMGET, one HSET and one ZADD, whatever the batch size; each entry costs one
-- plain find in its slot's packed records, not a decode of them. Counters: delivered,
-- buffered, superseded ("recorded" is their first two summed by the reader). One pending record per slot
-- and layer (newest wins, the older counted as superseded, also within one batch).

local live_key, pending_key, expiry_key, stats_key, reply_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]

local cached = redis.call('GET', reply_key)
if cached then
  redis.call('HINCRBY', stats_key, 'replayed', 1)
  return cached
end

local now = now_ms(ARGV[1])
local layer = ARGV[2]
local deadline = now + tonumber(ARGV[3])
local at = fmt(now)

sweep(pending_key, expiry_key, stats_key, now, tonumber(ARGV[6]))

local slots, tails = {}, {}
local n = 0
for slot, tail in string.gmatch(ARGV[7], '([^,;]*),([^;]*);') do
  n = n + 1
  slots[n], tails[n] = slot, tail
end

local holders = redis.call('HMGET', live_key, unpack(slots))

local flags = {}
local buffered = {}
local nbuffered = 0
for i = 1, n do
  local holder = holders[i]
  local delivered = false
  if holder then
    local bar = string.find(holder, '|', 1, true)
    if tonumber(string.sub(holder, bar + 1)) > now then
      local tail = tails[i]
      local rid = string.sub(tail, string.find(tail, ',', 1, true) + 1)
      delivered = rid == '' or rid == string.sub(holder, 1, bar - 1)
    end
  end
  if delivered then
    flags[i] = 'D'
  else
    flags[i] = 'B'
    nbuffered = nbuffered + 1
    buffered[nbuffered] = i
  end
end

local superseded = 0
if nbuffered > 0 then
  -- Distinct slots in first-seen order; a slot twice in one batch keeps its newest entry.
  local index, order = {}, {}
  for k = 1, nbuffered do
    local slot = slots[buffered[k]]
    if not index[slot] then
      order[#order + 1] = slot
      index[slot] = #order
    end
  end
  local values = redis.call('HMGET', pending_key, unpack(order))
  local marker = ';' .. layer .. ','
  local suffix = ',' .. at .. ',' .. fmt(deadline)
  for k = 1, nbuffered do
    local i = buffered[k]
    local j = index[slots[i]]
    local value = values[j]
    local rec = marker .. tails[i] .. suffix
    if not value then
      values[j] = rec
    else
      local start = string.find(value, marker, 1, true)
      if start then
        local stop = string.find(value, ';', start + 1, true)
        values[j] = string.sub(value, 1, start - 1) .. rec .. (stop and string.sub(value, stop) or '')
        superseded = superseded + 1
      else
        values[j] = value .. rec
      end
    end
  end
  local hset, zadd, groups = {}, {'LT'}, {}
  for j, slot in ipairs(order) do
    hset[2 * j - 1] = slot
    hset[2 * j] = values[j]
    local group = group_of(slot)
    if not groups[group] then
      groups[group] = true
      zadd[#zadd + 1] = fmt(deadline)
      zadd[#zadd + 1] = group
    end
  end
  -- The expiry index lives and dies with the pending hash, so one PTTL serves both.
  local key_ttl = tonumber(ARGV[4])
  local before = hset_batch(pending_key, hset)
  redis.call('ZADD', expiry_key, unpack(zadd))
  if ensure_ttl(pending_key, before, key_ttl, (key_ttl - tonumber(ARGV[3])) / 2) then
    redis.call('PEXPIRE', expiry_key, key_ttl)
  end
end

-- "recorded" is delivered + buffered, added up when the counters are read.
count(stats_key, 'delivered', n - nbuffered)
count(stats_key, 'buffered', nbuffered)
count(stats_key, 'superseded', superseded)

local reply = 'ok|' .. at .. '|' .. table.concat(flags)
redis.call('SET', reply_key, reply, 'PX', ARGV[5])
return reply
