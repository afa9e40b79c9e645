-- commands_alone/finish.lua: the Redis commands lua/finish.lua runs when a request finishes
-- its own live task on a slot without pending signals, with as little Lua around them as they
-- allow. benchmarks/instructions.py counts it as the "commands alone" of the finish case: the
-- least this key layout costs for that call. It mirrors the measured state only (the rank has
-- no pending hash); it is not a buffer script (no holder is checked).
--
-- KEYS and ARGV: exactly lua/finish.lua's keys and args, so it is sent with the very arguments
-- ours is sent with.
-- KEYS[1] live     hash  (HGET slot, HDEL slot, "<slot>:doc" and "<slot>:recovery", HLEN)
-- KEYS[2] pending  hash  (HGET layers: none here)
-- KEYS[3] expiry   zset  (the sweep's ZRANGEBYSCORE, empty)
-- KEYS[4] stats    hash  (HINCRBY finished)
-- KEYS[5] reply    string, this call's idempotency token (GET, then SET ... PX)
-- ARGV[2] slot   ARGV[4] reply_ttl_ms   ARGV[5] sweep limit
--
-- Reply: "ok|<now ms>|1,0,0": ours' reply on this path.
--
-- Commands, in ours' order: GET reply, TIME, ZRANGEBYSCORE expiry, HGET live, HDEL live, HLEN
-- live, HINCRBY finished, HGET pending layers, SET reply PX.

local cached = redis.call('GET', KEYS[5])
if cached then
  return cached
end
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local slot = ARGV[2]

redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now, 'LIMIT', 0, ARGV[5])
redis.call('HGET', KEYS[1], slot)
redis.call('HDEL', KEYS[1], slot, slot .. ':doc', slot .. ':recovery')
redis.call('HLEN', KEYS[1])
redis.call('HINCRBY', KEYS[4], 'finished', 1)
redis.call('HGET', KEYS[2], 'layers')
local reply = 'ok|' .. string.format('%d', now) .. '|1,0,0'
redis.call('SET', KEYS[5], reply, 'PX', ARGV[4])
return reply
