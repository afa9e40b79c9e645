-- commands_alone/register.lua: the Redis commands lua/register.lua runs when it registers a
-- task on a free slot and pops that slot's pending signals (none, one or many), with as little
-- Lua around them as they allow. benchmarks/instructions.py counts it as the "commands alone"
-- of the register cases: the least this key layout costs for that call. It mirrors the
-- measured state only (the slot free, every pending signal recovered, no sweep or TTL refresh
-- due, other slots still pending); it is not a buffer script (no holder, deadline, need or
-- layer is checked).
--
-- KEYS and ARGV: exactly lua/register.lua's keys and args, so it is sent with the very
-- arguments ours is sent with.
-- KEYS[1] live     hash  (HGET slot, HSET slot, "<slot>:doc", "<slot>:recovery" and '~')
-- KEYS[2] pending  hash  (HGET layers; HMGET of the slot's field per layer, HDEL of those found
--                         and HLEN, when the rank has layers)
-- KEYS[3] expiry   zset  (the sweep's ZRANGEBYSCORE, empty)
-- KEYS[4] stats    hash  (HINCRBY registered, and recovered when some were)
-- KEYS[5] reply    string, this call's idempotency token (GET, then SET ... PX)
-- ARGV[2] slot   ARGV[3] request_id   ARGV[6] task document   ARGV[7] task_ttl_ms
-- ARGV[8] reply_ttl_ms   ARGV[10] sweep limit
--
-- Reply: "ok|<now ms>|<payload>", the payload "layer,tokens,request_id,recorded_at,;" per
-- signal: ours' reply when every popped signal is recovered.
--
-- Commands, in ours' order: GET reply, TIME, ZRANGEBYSCORE expiry, HGET live, HGET pending
-- layers, [HMGET pending (the slot's field per layer), HDEL pending (those found), HLEN
-- pending: when the rank has layers], HSET live, PTTL live, HINCRBY registered,
-- [HINCRBY recovered], SET reply PX.

-- The same encoding field and value as lua/_lib.lua's HASHTABLE_FIELD.
local MARKER = 'present so that this hash stays hashtable-encoded: HMGET is one lookup per field'

local cached = redis.call('GET', KEYS[5])
if cached then
  return cached
end
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local slot = ARGV[2]
redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now, 'LIMIT', 0, ARGV[10])
redis.call('HGET', KEYS[1], slot)

local parts, found = {}, {}
local list = redis.call('HGET', KEYS[2], 'layers')
if list then
  local layers, fields = {}, {}
  for layer in string.gmatch(list, '[^,]+') do
    layers[#layers + 1] = layer
    fields[#fields + 1] = slot .. ':' .. layer
  end
  local values = redis.call('HMGET', KEYS[2], unpack(fields))
  for i = 1, #fields do
    if values[i] then
      parts[#parts + 1] = layers[i] .. ',' .. string.match(values[i], '^(.*,)') .. ';'
      found[#found + 1] = fields[i]
    end
  end
  if #found > 0 then
    redis.call('HDEL', KEYS[2], unpack(found))
    redis.call('HLEN', KEYS[2])
  end
end
local payload = table.concat(parts)

redis.call('HSET', KEYS[1], slot, string.format('%d', now + ARGV[7]) .. '|' .. ARGV[3], slot .. ':doc', ARGV[6],
  slot .. ':recovery', payload, '~', MARKER)
redis.call('PTTL', KEYS[1])
redis.call('HINCRBY', KEYS[4], 'registered', 1)
if #found > 0 then
  redis.call('HINCRBY', KEYS[4], 'recovered', #found)
end
local reply = 'ok|' .. string.format('%d', now) .. '|' .. payload
redis.call('SET', KEYS[5], reply, 'PX', ARGV[8])
return reply
