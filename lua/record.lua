-- record.lua: deliver or buffer one batch of layer signals of one instance and rank.
--
-- KEYS[1] live     hash  slot -> "request_id|lease_deadline_ms" of the slot's task
-- KEYS[2] pending  hash  slot -> packed pending records (see _lib.lua)
-- KEYS[3] expiry   zset  slot scored by its earliest pending deadline
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
-- token returns the first reply and writes nothing new. One HMGET, one HSET and one ZADD per
-- call whatever the batch size; one pending record per slot and layer (newest wins, the older
-- counted as superseded).

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

local slots, tokens, rids = {}, {}, {}
for slot, tok, rid in string.gmatch(ARGV[7], '([^,;]*),([^,;]*),([^,;]*);') do
  local i = #slots + 1
  slots[i], tokens[i], rids[i] = slot, tok, rid
end

local holders = redis.call('HMGET', live_key, unpack(slots))

local flags = {}
local buffered_slots = {}
local delivered = 0
for i = 1, #slots do
  local holder, alive = parse_holder(holders[i], now)
  if alive and (rids[i] == '' or rids[i] == holder) then
    flags[i] = 'D'
    delivered = delivered + 1
  else
    flags[i] = 'B'
    buffered_slots[#buffered_slots + 1] = i
  end
end

local superseded = 0
if #buffered_slots > 0 then
  local distinct, order = {}, {}
  for _, i in ipairs(buffered_slots) do
    if not distinct[slots[i]] then
      distinct[slots[i]] = true
      order[#order + 1] = slots[i]
    end
  end
  local stored = redis.call('HMGET', pending_key, unpack(order))
  local by_slot = {}
  for j, slot in ipairs(order) do
    by_slot[slot] = parse_pending(stored[j])
  end
  for _, i in ipairs(buffered_slots) do
    local records = by_slot[slots[i]]
    local rec = {layer = layer, tokens = tokens[i], rid = rids[i], at = at, deadline = deadline}
    local replaced = false
    for j, old in ipairs(records) do
      if old.layer == layer then
        records[j] = rec
        replaced = true
        superseded = superseded + 1
        break
      end
    end
    if not replaced then
      records[#records + 1] = rec
    end
  end
  local hset, zadd = {}, {}
  for _, slot in ipairs(order) do
    local records = by_slot[slot]
    hset[#hset + 1] = slot
    hset[#hset + 1] = encode_pending(records)
    zadd[#zadd + 1] = earliest_deadline(records)
    zadd[#zadd + 1] = slot
  end
  redis.call('HSET', pending_key, unpack(hset))
  redis.call('ZADD', expiry_key, unpack(zadd))
  extend_ttl(pending_key, tonumber(ARGV[4]))
  extend_ttl(expiry_key, tonumber(ARGV[4]))
end

count(stats_key, 'recorded', #slots)
count(stats_key, 'delivered', delivered)
count(stats_key, 'buffered', #buffered_slots)
count(stats_key, 'superseded', superseded)

local reply = 'ok|' .. at .. '|' .. table.concat(flags)
redis.call('SET', reply_key, reply, 'PX', ARGV[5])
return reply
