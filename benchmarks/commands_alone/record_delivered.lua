-- commands_alone/record_delivered.lua: the Redis commands lua/record.lua runs on its delivering
-- path (every slot of the batch has a live task, no sweep due), with as little Lua around them
-- as they allow. benchmarks/instructions.py counts it as the "commands alone" of the
-- record.delivered cases: the least this key layout costs for that call. Not a buffer script:
-- it checks no lease and no request id, and never buffers.
--
-- KEYS and ARGV: exactly lua/record.lua's, so it is sent with the very arguments ours is sent.
-- KEYS[1] live     hash  (HMGET of the batch's slots and '~')
-- KEYS[2] pending  hash  (unused here)      KEYS[3] expiry  zset  (unused here)
-- KEYS[4] stats    hash  (HINCRBY delivered)
-- KEYS[5] reply    string, this call's idempotency token (GET, then SET ... PX)
-- ARGV[1] now_ms (unused: always the server's TIME, as in the measured calls)
-- ARGV[2] layer, ARGV[3] pending_ttl_ms, ARGV[4] pending key TTL, ARGV[6] sweep limit,
--         ARGV[8] request-id flag (unused here)
-- ARGV[5] reply_ttl_ms
-- ARGV[7] entries, packed "slot,tokens,request_id;"
--
-- Reply: "ok|<now, 16 digits>|" and one D per entry: ours' reply on this path, same length.
--
-- Commands, in ours' order: GET reply, TIME, one HMGET of live (slots + '~'), one HINCRBY, SET
-- reply PX. The slots come from one gmatch capturing only them, the cheapest way known to us
-- (and the one record.lua uses); the holders HMGET returns are not looked at.

local cached = redis.call('GET', KEYS[5])
if cached then
  return cached
end
local t = redis.call('TIME')
local now16 = string.format('%016d', t[1] * 1000 + math.floor(t[2] / 1000))

local slots, n = {}, 0
for slot in string.gmatch(ARGV[7], '([^,;]*),[^;]*;') do
  n = n + 1
  slots[n] = slot
end
slots[n + 1] = '~'
redis.call('HMGET', KEYS[1], unpack(slots))

redis.call('HINCRBY', KEYS[4], 'delivered', n)
local reply = 'ok|' .. now16 .. '|' .. string.rep('D', n)
redis.call('SET', KEYS[5], reply, 'PX', ARGV[5])
return reply
