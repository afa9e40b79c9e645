-- finish.lua: FCALL rls_v2_finish_<digest>, release a slot when its request is done (or aborted),
-- fenced by request id.
--
-- keys[1] live     hash    slot -> "<lease deadline ms, 16 digits>|<request id>";
--                          "<slot>:doc" -> task document; "<slot>:recovery" -> its first
--                          payload; '~'
-- keys[2] pending  hash    "<slot>:<layer>" -> pending signal; "layers" (see _lib.lua)
-- keys[3] expiry   zset    slot group -> at or before its earliest pending deadline
-- keys[4] stats    hash    counters (no TTL)
-- keys[5] reply    string  this call's idempotency token
-- keys[6] ended    hash    slot -> "<finished at ms>|<request id>": the slot's latest finish
-- args[1] now_ms: the time the call decides at (empty: server TIME; a replay: the time of
--         the finish it replays)
-- args[2] slot   args[3] request_id
-- args[4] reply_ttl_ms                  args[5] sweep limit
-- args[6] pending_ttl_ms                args[7] ended key TTL in ms (pending_ttl + grace)
--
-- Reply: "ok|<now ms>|<removed>,<dropped>,<fenced>" (removed and fenced are 0 or 1).
--
-- Guarantees: when another live request holds the slot nothing changes (fenced), so a late
-- finish never touches the next request's task or signals. Otherwise the task (if it is this
-- request's) is removed and the slot's pending signals of this request, or of no known
-- request, are dropped and counted; signals that name another request stay for that request.
-- A resend with the same token returns the first reply, so a retried finish cannot drop a
-- signal recorded after the first run. Unless fenced, the finish is remembered in `ended` for
-- the pending TTL: a signal written back later (a replayed record, lua/record.lua) that was
-- recorded before it is dropped as this finish would have dropped it, never left for the
-- slot's next request.
--
-- Flag allow-oom: finish only frees memory, so it runs on a server at maxmemory (noeviction),
-- which then drains as requests finish. What it adds is bounded: the reply key (a few dozen
-- bytes, expiring after reply_ttl_ms), counter increments in the stats hash, and one field
-- per slot in `ended`.

local function finish(keys, args)
  local live_key, pending_key, expiry_key, stats_key, reply_key = keys[1], keys[2], keys[3], keys[4], keys[5]
  local ended_key = keys[6]

  local cached = replayed_reply(reply_key, stats_key)
  if cached then
    return cached
  end

  local now = now_ms(args[1])
  local slot, request_id = args[2], args[3]
  local head = 'ok|' .. fmt(now) .. '|'

  sweep(pending_key, expiry_key, stats_key, now, args[5])

  local holder_id, alive = holder(redis.call('HGET', live_key, slot), now)
  if alive and holder_id ~= request_id then
    redis.call('HINCRBY', stats_key, 'fenced', 1)
    return remember_reply(reply_key, head .. '0,0,1', args[4])
  end

  redis.call('HSET', ended_key, slot, fmt(now) .. '|' .. request_id)
  keep_alive(ended_key, nil, tonumber(args[6]), tonumber(args[7]))

  local removed = 0
  if holder_id == request_id then
    -- The lease, the task document and the first recovery go together. A released rank
    -- leaves no keys: live goes when only its encoding field is left.
    redis.call('HDEL', live_key, slot, slot .. ':doc', slot .. ':recovery')
    if redis.call('HLEN', live_key) <= 1 then
      redis.call('DEL', live_key)
    end
    removed = 1
    redis.call('HINCRBY', stats_key, 'finished', 1)
  end

  local fields = slot_fields(slot, pending_layers(pending_key))
  local values = hmget(pending_key, fields)
  local doomed = {}
  for i = 1, #fields do
    if values[i] then
      local _, rid = parse_signal(values[i])
      if rid == '' or rid == request_id then
        doomed[#doomed + 1] = fields[i]
      end
    end
  end
  if #doomed > 0 then
    hdel(pending_key, doomed)
    drop_pending_if_empty(pending_key, expiry_key)
    redis.call('HINCRBY', stats_key, 'finish_dropped', #doomed)
  end

  return remember_reply(reply_key, head .. removed .. ',' .. #doomed .. ',0', args[4])
end

redis.register_function{function_name = 'rls_v2_finish_' .. DIGEST, callback = finish, flags = {'allow-oom'}}
