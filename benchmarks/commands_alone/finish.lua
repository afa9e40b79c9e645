-- commands_alone/finish.lua: the Redis commands lua/finish.lua runs when a request finishes
-- the slot it holds and the slot has no pending signals, with as little Lua around them as
-- they allow. benchmarks/instructions.py counts it as the "commands alone" of the finish case:
-- the least this key layout costs for that call. It mirrors the measured state only (the
-- request holds the slot, nothing pending on the rank, other tasks still live); it is not a
-- buffer script (no fencing: the holder is not compared).
--
-- KEYS and ARGV: exactly lua/finish.lua's, so it is sent with the very arguments ours is sent.
-- KEYS[1] live     hash  (HGET slot, HDEL slot, HLEN)
-- KEYS[2] tasks    hash  (HDEL slot and "<slot>:recovery")
-- KEYS[3] pending  hash  (HMGET slot and '~')
-- KEYS[4] expiry   zset  (unused here)
-- KEYS[5] stats    hash  (HINCRBY finished)
-- KEYS[6] reply    string, this call's idempotency token (GET, then SET ... PX)
-- ARGV[1] now_ms (unused: always the server's TIME, as in the measured calls)
-- ARGV[2] slot     ARGV[3] request_id (unused here)     ARGV[4] reply_ttl_ms
-- ARGV[5] sweep limit (unused here)
--
-- Reply: "ok|<now, 16 digits>|1,0,0": ours' reply for a removed task and nothing dropped.
--
-- Commands, in ours' order: GET reply, TIME, HMGET pending (slot + '~'), HGET live slot, HDEL
-- live slot, HLEN live, HDEL tasks (slot, "<slot>:recovery"), HINCRBY finished, SET reply PX.

local cached = redis.call('GET', KEYS[6])
if cached then
  return cached
end
local t = redis.call('TIME')
local now16 = string.format('%016d', t[1] * 1000 + math.floor(t[2] / 1000))
local slot = ARGV[2]

redis.call('HMGET', KEYS[3], slot, '~')
redis.call('HGET', KEYS[1], slot)
redis.call('HDEL', KEYS[1], slot)
redis.call('HLEN', KEYS[1])
redis.call('HDEL', KEYS[2], slot, slot .. ':recovery')
redis.call('HINCRBY', KEYS[5], 'finished', 1)
local reply = 'ok|' .. now16 .. '|1,0,0'
redis.call('SET', KEYS[6], reply, 'PX', ARGV[4])
return reply
