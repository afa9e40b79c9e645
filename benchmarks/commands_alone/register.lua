-- commands_alone/register.lua: the Redis commands lua/register.lua runs when it registers a
-- task on a free slot and pops that slot's pending signals (none, one or many), with as little
-- Lua around them as they allow. benchmarks/instructions.py counts it as the "commands alone"
-- of the register cases: the least this key layout costs for that call. It mirrors the
-- measured state only (the slot free, every pending signal recovered, in layer order, no sweep
-- or TTL refresh due, other slots still pending); it is not a buffer script (no holder,
-- deadline, need or layer is checked).
--
-- KEYS and ARGV: exactly lua/register.lua's, so it is sent with the very arguments ours is sent.
-- KEYS[1] live     hash  (HMGET slot and '~', HSET slot)
-- KEYS[2] tasks    hash  (HSET slot and "<slot>:recovery")
-- KEYS[3] pending  hash  (HMGET slot and '~'; HDEL slot and HLEN when the slot held signals)
-- KEYS[4] expiry   zset  (unused here)
-- KEYS[5] stats    hash  (HINCRBY registered, and recovered when some were)
-- KEYS[6] reply    string, this call's idempotency token (GET, then SET ... PX)
-- ARGV[1] now_ms (unused: always the server's TIME, as in the measured calls)
-- ARGV[2] slot       ARGV[3] request_id      ARGV[6] task document
-- ARGV[7] task_ttl_ms                        ARGV[8] reply_ttl_ms
-- ARGV[4] need_prefill_tokens, ARGV[5] num_layers, ARGV[9] replace, ARGV[10] sweep limit,
--         ARGV[11] live/tasks key TTL (unused here)
--
-- Reply: "ok|<now, 16 digits>|<payload>", the payload "layer,tokens,request_id,recorded_at,;"
-- per signal: ours' reply when every popped signal is recovered.
--
-- Commands, in ours' order: GET reply, TIME, HMGET pending (slot + '~'), HMGET live (slot +
-- '~'), [HDEL pending slot, HLEN pending: only when the slot held signals], HSET live, HSET
-- tasks, HINCRBY registered, [HINCRBY recovered], SET reply PX. The payload is the slot's
-- packed records with each deadline dropped, by one gsub (in C) over the whole field.

local cached = redis.call('GET', KEYS[6])
if cached then
  return cached
end
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local slot = ARGV[2]

local stored = redis.call('HMGET', KEYS[3], slot, '~')[1]
redis.call('HMGET', KEYS[1], slot, '~')
local payload, recovered = '', 0
if stored then
  payload, recovered = string.gsub(stored, ';([^;]*,)%d*', '%1;')
  redis.call('HDEL', KEYS[3], slot)
  redis.call('HLEN', KEYS[3])
end

redis.call('HSET', KEYS[1], slot, string.format('%016d', now + ARGV[7]) .. '|' .. ARGV[3])
redis.call('HSET', KEYS[2], slot, ARGV[6], slot .. ':recovery', payload)
redis.call('HINCRBY', KEYS[5], 'registered', 1)
if recovered > 0 then
  redis.call('HINCRBY', KEYS[5], 'recovered', recovered)
end
local reply = 'ok|' .. string.format('%016d', now) .. '|' .. payload
redis.call('SET', KEYS[6], reply, 'PX', ARGV[8])
return reply
