-- register.lua: make a cache task the holder of its slot and hand it the slot's early signals.
--
-- KEYS[1] live     hash  slot -> "<lease deadline ms, 16 digits>|request_id"; "~" -> marker
-- KEYS[2] tasks    hash  slot -> task document (opaque here); "<slot>:recovery" -> its reply
-- KEYS[3] pending  hash  slot -> packed pending records; "~" -> marker (see _lib.lua)
-- KEYS[4] expiry   zset  slot group -> earliest pending deadline of the group (see _lib.lua)
-- KEYS[5] stats    hash  counters (no TTL)
-- KEYS[6] reply    string, this call's idempotency token
-- ARGV[1] now_ms (empty: server TIME)   ARGV[2] slot            ARGV[3] request_id
-- ARGV[4] need_prefill_tokens           ARGV[5] num_layers      ARGV[6] task document
-- ARGV[7] task_ttl_ms                   ARGV[8] reply_ttl_ms    ARGV[9] replace ("1" or "0")
-- ARGV[10] sweep limit                  ARGV[11] live/tasks key TTL in ms (task_ttl + grace)
--
-- Reply: "<status>|<now>|<payload>"
--   ok       payload = popped signals sorted by layer, "layer,tokens,request_id,recorded_at,reason;"
--            with reason empty for a recovered signal
--   again    the same request already holds the slot: payload is its first recovery, unchanged
--   replaced as ok, after taking the slot from another live request (ARGV[9] = "1")
--   occupied payload = the request id that holds the slot; only the refusal is counted
--
-- Guarantees: registration and the pop happen together, so a signal recorded concurrently is
-- either delivered by record or recovered here. Every popped signal is returned once, as
-- recovered or dropped with a reason (expired, request_mismatch, layer_out_of_range,
-- non_positive, over_need, checked in that order).

local live_key, tasks_key, pending_key, expiry_key, stats_key, reply_key =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]

local cached = replayed_reply(reply_key, stats_key)
if cached then
  return cached
end

local now = now_ms(ARGV[1])
local slot, request_id = ARGV[2], ARGV[3]
-- Canonical decimals (the client's validated ints), compared as such: see below.
local need, num_layers = ARGV[4], ARGV[5]
local task_ttl = tonumber(ARGV[7])
local now16 = ms16(now)

local stored, meta = slot_pending(pending_key, expiry_key, stats_key, slot, now, now16, ARGV[10])

local live = redis.call('HMGET', live_key, slot, HASHTABLE_FIELD)
local holder, alive = parse_holder(live[1], now16)
local status = 'ok'
-- Every reply, refusals included, is kept under the token: a resend must not count twice.
local reply_ttl = ARGV[8]

if alive and holder == request_id then
  redis.call('HINCRBY', stats_key, 'reregistered', 1)
  local first = redis.call('HGET', tasks_key, slot .. ':recovery') or ''
  return remember_reply(reply_key, 'again|' .. now16 .. '|' .. first, reply_ttl)
end
if alive then
  if ARGV[9] ~= '1' then
    redis.call('HINCRBY', stats_key, 'occupied', 1)
    return remember_reply(reply_key, 'occupied|' .. now16 .. '|' .. holder, reply_ttl)
  end
  status = 'replaced'
  redis.call('HINCRBY', stats_key, 'replaced', 1)
end

-- One pass over the slot's records: each becomes a payload part, with its reason. Records are
-- kept in arrival order, usually ascending layers: the parts are sorted only when they are not.
-- Every number here is a canonical decimal string of digits (a validated int printed by the
-- client, or a time printed with %d), so "a < b" is "shorter, or as long and below": no
-- tonumber, the dearest step of this loop (one per field and record). Digits only, so the
-- byte comparison is the same under any LC_COLLATE the server runs with (Lua compares strings
-- with strcoll).
local payload, recovered, dropped = '', 0, nil
if stored then
  local parts, layers = {}, {}
  local popped = 0
  local sorted = true
  local now_text = fmt(now)
  for _, layer, tokens, rid, at, deadline in records(stored) do
    local reason = ''
    if #deadline < #now_text or #deadline == #now_text and deadline <= now_text then
      reason = 'expired'
    elseif rid ~= '' and rid ~= request_id then
      reason = 'request_mismatch'
    elseif #layer > #num_layers or #layer == #num_layers and layer >= num_layers then
      reason = 'layer_out_of_range'
    elseif tokens == '0' then -- record takes tokens >= 0 only
      reason = 'non_positive'
    elseif #tokens > #need or #tokens == #need and tokens > need then
      reason = 'over_need'
    end
    if reason == '' then
      recovered = recovered + 1
    else
      dropped = dropped or {}
      dropped[reason] = (dropped[reason] or 0) + 1
    end
    popped = popped + 1
    if popped > 1 then
      local before = layers[popped - 1]
      if #layer < #before or #layer == #before and layer < before then
        sorted = false
      end
    end
    parts[popped] = layer .. ',' .. tokens .. ',' .. rid .. ',' .. at .. ',' .. reason .. ';'
    layers[popped] = layer
  end
  if not sorted then
    local by_layer = {}
    for i = 1, popped do
      by_layer[i] = i
    end
    table.sort(by_layer, function(x, y) return tonumber(layers[x]) < tonumber(layers[y]) end)
    for i = 1, popped do
      by_layer[i] = parts[by_layer[i]]
    end
    parts = by_layer
  end
  payload = table.concat(parts)
  clear_pending(pending_key, expiry_key, slot)
end

-- live and tasks gain and lose their fields together, so their TTLs are refreshed together,
-- once half the grace is used: the live marker says when (a PTTL under an injected clock).
local key_ttl = tonumber(ARGV[11])
local hset = {slot, ms16(now + task_ttl) .. '|' .. request_id}
local live_expires, live_due = read_live_marker(live[2] or nil)
-- A new marker's next due: the earlier of its own and the pending marker's (a lower bound
-- too), or none pending.
local due = live_due or FAR16
if meta and meta.due < due then
  due = meta.due
end
local refresh, expires = ttl_refresh(live_key, live_expires, now, ARGV[1] ~= '', key_ttl, task_ttl)
if expires ~= live_expires then
  hset[3], hset[4] = HASHTABLE_FIELD, live_marker(expires, due)
end
redis.call('HSET', live_key, unpack(hset))
redis.call('HSET', tasks_key, slot, ARGV[6], slot .. ':recovery', payload)
if refresh then
  redis.call('PEXPIRE', live_key, key_ttl)
  redis.call('PEXPIRE', tasks_key, key_ttl)
end

redis.call('HINCRBY', stats_key, 'registered', 1)
count(stats_key, 'recovered', recovered)
if dropped then
  for reason, n in pairs(dropped) do
    count(stats_key, 'dropped_' .. reason, n)
  end
end

return remember_reply(reply_key, status .. '|' .. now16 .. '|' .. payload, reply_ttl)
