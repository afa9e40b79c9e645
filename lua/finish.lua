-- finish.lua: release a slot when its request is done (or aborted), fenced by request id.
--
-- KEYS[1] live     hash  slot -> "<lease deadline ms, 16 digits>|request_id"; "~" -> marker
-- KEYS[2] tasks    hash  slot -> task document; "<slot>:recovery" -> its recovery
-- KEYS[3] pending  hash  slot -> packed pending records; "~" -> marker (see _lib.lua)
-- KEYS[4] expiry   zset  slot group -> earliest pending deadline of the group (see _lib.lua)
-- KEYS[5] stats    hash  counters (no TTL)
-- KEYS[6] reply    string, this call's idempotency token
-- ARGV[1] now_ms (empty: server TIME)   ARGV[2] slot   ARGV[3] request_id
-- ARGV[4] reply_ttl_ms                  ARGV[5] sweep limit
--
-- Reply: "ok|<now>|<removed>,<dropped>,<fenced>" (removed and fenced are 0 or 1).
--
-- Guarantees: when another live request holds the slot nothing changes (fenced), so a late
-- finish never touches the next request's task or signals. Otherwise the task (if it is this
-- request's) is removed and the slot's pending signals of this request, or of no known
-- request, are dropped and counted; signals that name another request stay for that request.
-- A resend with the same token returns the first reply, so a retried finish cannot drop a
-- signal recorded after the first run.

local live_key, tasks_key, pending_key, expiry_key, stats_key, reply_key =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]

local cached = replayed_reply(reply_key, stats_key)
if cached then
  return cached
end

local now = now_ms(ARGV[1])
local slot, request_id = ARGV[2], ARGV[3]

local now16 = ms16(now)
local stored = slot_pending(pending_key, expiry_key, stats_key, slot, now, now16, ARGV[5])

local reply
local holder, alive = parse_holder(redis.call('HGET', live_key, slot), now16)
if alive and holder ~= request_id then
  redis.call('HINCRBY', stats_key, 'fenced', 1)
  reply = 'ok|' .. now16 .. '|0,0,1'
else
  local removed = 0
  if holder == request_id then
    redis.call('HDEL', live_key, slot)
    drop_if_empty(live_key)
    redis.call('HDEL', tasks_key, slot, slot .. ':recovery')
    removed = 1
    redis.call('HINCRBY', stats_key, 'finished', 1)
  end
  local kept, dropped, from = {}, 0, 2
  for after, _, _, rid in records(stored) do
    if rid == '' or rid == request_id then
      dropped = dropped + 1
    else
      kept[#kept + 1] = sub(stored, from - 1, after - 2)
    end
    from = after
  end
  if dropped > 0 then
    store_pending(pending_key, expiry_key, slot, table.concat(kept))
    redis.call('HINCRBY', stats_key, 'finish_dropped', dropped)
  end
  reply = 'ok|' .. now16 .. '|' .. removed .. ',' .. dropped .. ',0'
end

return remember_reply(reply_key, reply, ARGV[4])
