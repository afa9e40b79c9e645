-- commands_alone/record_buffered.lua: the Redis commands lua/record.lua runs on its buffering
-- path, with as little Lua around them as they allow. benchmarks/instructions.py counts it as
-- the "commands alone" of the record.buffered and record.half cases: the least this key layout
-- costs for that call. It mirrors the measured state only, where every slot without a holder
-- already holds a pending signal of this layer, replaced by the new one, the layer is already
-- in "layers", and no sweep or TTL refresh is due; it is not a buffer script (no lease
-- deadline or request id is looked at).
--
-- KEYS and ARGV: exactly lua/record.lua's keys and args, so it is sent with the very
-- arguments ours is sent with.
-- KEYS[1] live     hash  (HMGET of the batch's slots)
-- KEYS[2] pending  hash  (HSET of the buffered entries' "<slot>:<layer>" fields, HGET layers)
-- KEYS[3] expiry   zset  (the sweep's ZRANGEBYSCORE, empty; ZADD LT of the buffered slots' groups)
-- KEYS[4] stats    hash  (HINCRBY delivered when some are, buffered, superseded)
-- KEYS[5] reply    string, this call's idempotency token (GET, then SET ... PX)
-- ARGV[2] layer   ARGV[3] pending_ttl_ms   ARGV[5] reply_ttl_ms   ARGV[6] sweep limit
-- ARGV[7] the entries' slots, "slot," each   ARGV[9] their rests, "tokens,request_id;" each
--
-- Reply: "ok|<now ms>|" and one flag per entry, D (the slot has a holder) or B: ours' reply.
--
-- Commands, in ours' order: GET reply, TIME, ZRANGEBYSCORE expiry, HMGET live (the batch's
-- slots), HSET pending (one field per buffered entry), HGET pending layers, ZADD expiry LT (one
-- score per 8-slot group), PTTL pending, HINCRBY delivered (only when some entry is),
-- HINCRBY buffered, HINCRBY superseded, SET reply PX.

local cached = redis.call('GET', KEYS[5])
if cached then
  return cached
end
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now, 'LIMIT', 0, ARGV[6])
local deadline = string.format('%d', now + ARGV[3])
local suffix = ',' .. string.format('%d', now) .. ',' .. deadline

local slots, rests, n = {}, {}, 0
for slot in string.gmatch(ARGV[7], '[^,]+') do
  n = n + 1
  slots[n] = slot
end
for rest in string.gmatch(ARGV[9], '[^;]+') do
  rests[#rests + 1] = rest
end
local holders = redis.call('HMGET', KEYS[1], unpack(slots))

local hset, zadd, groups, flags, nb = {}, {'LT'}, {}, {}, 0
for i = 1, n do
  if holders[i] then
    flags[i] = 'D'
  else
    flags[i] = 'B'
    nb = nb + 1
    hset[2 * nb - 1] = slots[i] .. ':' .. ARGV[2]
    hset[2 * nb] = rests[i] .. suffix
    local group = math.floor(slots[i] / 8)
    if not groups[group] then
      groups[group] = true
      zadd[#zadd + 1] = deadline
      zadd[#zadd + 1] = group
    end
  end
end
if nb > 0 then
  redis.call('HSET', KEYS[2], unpack(hset))
  redis.call('HGET', KEYS[2], 'layers')
  redis.call('ZADD', KEYS[3], unpack(zadd))
  redis.call('PTTL', KEYS[2])
end

if nb < n then
  redis.call('HINCRBY', KEYS[4], 'delivered', n - nb)
end
if nb > 0 then
  redis.call('HINCRBY', KEYS[4], 'buffered', nb)
  redis.call('HINCRBY', KEYS[4], 'superseded', nb)
end
local reply = 'ok|' .. string.format('%d', now) .. '|' .. table.concat(flags)
redis.call('SET', KEYS[5], reply, 'PX', ARGV[5])
return reply
