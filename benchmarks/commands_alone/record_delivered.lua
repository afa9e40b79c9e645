-- commands_alone/record_delivered.lua: the Redis commands lua/record.lua runs when every entry
-- is delivered, with as little Lua around them as they allow. benchmarks/instructions.py counts
-- it as the "commands alone" of the record.delivered cases: the least this key layout costs
-- for that call. It mirrors the measured state only (every slot has a live task, nothing is
-- due for the sweep); it is not a buffer script (no lease deadline or request id is looked at).
--
-- KEYS and ARGV: exactly lua/record.lua's keys and args, so it is sent with the very
-- arguments ours is sent with.
-- KEYS[1] live     hash  (HMGET of the batch's slots)
-- KEYS[3] expiry   zset  (the sweep's ZRANGEBYSCORE, empty)
-- KEYS[4] stats    hash  (HINCRBY delivered)
-- KEYS[5] reply    string, this call's idempotency token (GET, then SET ... PX)
-- ARGV[5] reply_ttl_ms   ARGV[6] sweep limit   ARGV[7] the entries' slots, "slot," each
--
-- Reply: "ok|<now ms>|" and a D per entry: ours' reply on this path.
--
-- Commands, in ours' order: GET reply, TIME, ZRANGEBYSCORE expiry, HMGET live (the batch's
-- slots), HINCRBY delivered, SET reply PX.

local cached = redis.call('GET', KEYS[5])
if cached then
  return cached
end
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now, 'LIMIT', 0, ARGV[6])

local slots, n = {}, 0
for slot in string.gmatch(ARGV[7], '[^,]+') do
  n = n + 1
  slots[n] = slot
end
redis.call('HMGET', KEYS[1], unpack(slots))

redis.call('HINCRBY', KEYS[4], 'delivered', n)
local reply = 'ok|' .. string.format('%d', now) .. '|' .. string.rep('D', n)
redis.call('SET', KEYS[5], reply, 'PX', ARGV[5])
return reply
