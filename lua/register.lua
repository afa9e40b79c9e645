-- register.lua: FCALL rls_v2_register_<digest>, make a cache task the holder of its slot and hand it the
-- slot's early signals.
--
-- keys[1] live     hash    slot -> "<lease deadline ms, 16 digits>|<request id>";
--                          "<slot>:doc" -> task document; "<slot>:recovery" -> its first
--                          payload; '~'
-- keys[2] pending  hash    "<slot>:<layer>" -> pending signal; "layers" (see _lib.lua)
-- keys[3] expiry   zset    slot group -> at or before its earliest pending deadline
-- keys[4] stats    hash    counters (no TTL)
-- keys[5] reply    string  this call's idempotency token
-- args[1] now_ms: the time the call decides at (empty: server TIME); a replay passes the
--         time of the registration it replays, on the server's clock
-- args[2] slot            args[3] request_id
-- args[4] need_prefill_tokens           args[5] num_layers      args[6] task document
-- args[7] task_ttl_ms                   args[8] reply_ttl_ms    args[9] replace ("1" or "0")
-- args[10] sweep limit                  args[11] live key TTL in ms (task_ttl + grace)
--
-- Reply: "<status>|<now ms>|<payload>"
--   ok       payload = popped signals by layer, "layer,tokens,request_id,recorded_at,reason;"
--            with reason empty for a recovered signal
--   again    the same request already holds the slot: payload is its first recovery, unchanged
--   replaced as ok, after taking the slot from another live request (args[9] = "1")
--   occupied payload = the request id that holds the slot; only the refusal is counted
--
-- Guarantees: registration and the pop happen together, so a signal recorded concurrently is
-- either delivered by record or recovered here. Every popped signal is returned once, as
-- recovered or dropped with a reason (expired, request_mismatch, layer_out_of_range,
-- non_positive, over_need, checked in that order). The pop is one HMGET of the slot's field
-- for each layer buffered on the rank (the model's layers: what the task's own layers cost
-- to read) and one HDEL of those found.

local function register(keys, args)
  local live_key, pending_key, expiry_key, stats_key, reply_key = keys[1], keys[2], keys[3], keys[4], keys[5]

  local cached = replayed_reply(reply_key, stats_key)
  if cached then
    return cached
  end

  local now = now_ms(args[1])
  local slot, request_id = args[2], args[3]
  local need, num_layers = tonumber(args[4]), tonumber(args[5])
  -- Every reply, refusals included, is kept under the token: a resend must not count twice.
  local reply_ttl = args[8]
  local head = '|' .. fmt(now) .. '|'

  sweep(pending_key, expiry_key, stats_key, now, args[10])

  local status = 'ok'
  local holder_id, alive = holder(redis.call('HGET', live_key, slot), now)
  if alive and holder_id == request_id then
    redis.call('HINCRBY', stats_key, 'reregistered', 1)
    local first = redis.call('HGET', live_key, slot .. ':recovery') or ''
    return remember_reply(reply_key, 'again' .. head .. first, reply_ttl)
  end
  if alive then
    if args[9] ~= '1' then
      redis.call('HINCRBY', stats_key, 'occupied', 1)
      return remember_reply(reply_key, 'occupied' .. head .. holder_id, reply_ttl)
    end
    status = 'replaced'
    redis.call('HINCRBY', stats_key, 'replaced', 1)
  end

  -- Pop the slot's signals, in layer order (the rank's layers are kept ascending).
  local layers = pending_layers(pending_key)
  local fields = slot_fields(slot, layers)
  local values = hmget(pending_key, fields)
  local parts, popped, recovered, dropped = {}, {}, 0, {}
  for i, layer in ipairs(layers) do
    local value = values[i]
    if value then
      -- "tokens,request_id,recorded_at," is the payload's part as stored, the deadline follows
      -- (the layout parse_signal reads; matched here to keep that part whole).
      local stored, tokens_text, rid, deadline = string.match(value, '^(([^,]*),([^,]*),[^,]*,)(.*)$')
      local tokens = tonumber(tokens_text)
      local reason = ''
      if tonumber(deadline) <= now then
        reason = 'expired'
      elseif rid ~= '' and rid ~= request_id then
        reason = 'request_mismatch'
      elseif tonumber(layer) >= num_layers then
        reason = 'layer_out_of_range'
      elseif tokens <= 0 then
        reason = 'non_positive'
      elseif tokens > need then
        reason = 'over_need'
      end
      if reason == '' then
        recovered = recovered + 1
      else
        dropped[reason] = (dropped[reason] or 0) + 1
      end
      parts[#parts + 1] = layer .. ',' .. stored .. reason .. ';'
      popped[#popped + 1] = fields[i]
    end
  end
  local payload = table.concat(parts)
  if #popped > 0 then
    hdel(pending_key, popped)
    drop_pending_if_empty(pending_key, expiry_key)
  end

  -- The lease, the task document and the first recovery: one HSET of the live hash.
  local task_ttl = tonumber(args[7])
  redis.call('HSET', live_key, slot, ms16(now + task_ttl) .. '|' .. request_id, slot .. ':doc', args[6],
    slot .. ':recovery', payload, HASHTABLE_FIELD, HASHTABLE_VALUE)
  keep_alive(live_key, nil, task_ttl, tonumber(args[11]))

  redis.call('HINCRBY', stats_key, 'registered', 1)
  count(stats_key, 'recovered', recovered)
  for reason, n in pairs(dropped) do
    count(stats_key, 'dropped_' .. reason, n)
  end

  return remember_reply(reply_key, status .. head .. payload, reply_ttl)
end

redis.register_function('rls_v2_register_' .. DIGEST, register)
