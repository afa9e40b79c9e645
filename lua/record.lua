-- record.lua: deliver or buffer one batch of layer signals of one instance and rank.
--
-- KEYS[1] live     hash  slot -> "<lease deadline ms, 16 digits>|request_id"; "~" -> marker
-- KEYS[2] pending  hash  slot -> packed pending records; "~" -> marker (see _lib.lua)
-- KEYS[3] expiry   zset  slot group -> earliest pending deadline of the group (see _lib.lua)
-- KEYS[4] stats    hash  counters (no TTL)
-- KEYS[5] reply    string, this call's idempotency token: the reply, kept reply_ttl_ms
-- ARGV[1] now_ms (empty: server TIME)      ARGV[2] layer
-- ARGV[3] pending_ttl_ms                   ARGV[4] pending key TTL in ms (pending_ttl + grace)
-- ARGV[5] reply_ttl_ms                     ARGV[6] sweep limit (slots per run)
-- ARGV[7] entries, packed "slot,tokens,request_id;" (request_id empty when unknown)
-- ARGV[8] "1" when some entry carries a request id, else "0"
--
-- Reply: "ok|<now>|<flags>", one flag per entry in order: D delivered (the slot has a live
-- task of this request, or of any request when the signal carries none), B buffered. <now> is
-- the time used, in ms as a 16-digit stamp (leading zeros), as in every script's reply.
--
-- Guarantees: the liveness check and the buffering happen in this one script, so a signal is
-- either delivered here or buffered, never both and never neither. A resend with the same
-- token returns the first reply and writes nothing new. One HMGET of live, and for buffered
-- entries one HMGET, one HSET and at most one ZADD, whatever the batch size; each entry costs
-- one plain find in its slot's packed records, not a decode of them. Counters: delivered,
-- buffered, superseded ("recorded" is the first two summed by the reader). One pending record
-- per slot and layer (newest wins, the older counted as superseded, also within one batch).

local live_key, pending_key, expiry_key, stats_key, reply_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]

local cached = replayed_reply(reply_key, stats_key)
if cached then
  return cached
end

local now = now_ms(ARGV[1])
local layer = ARGV[2]

-- Slots as strings (HMGET wants them) and nothing else: the rest of an entry is found again by
-- a plain find, in order, only for entries that need it (buffered, or checked against a
-- request id). A second capture per entry cost more than those finds.
local packed = ARGV[7]
local slots = {}
local n = 0
for slot in string.gmatch(packed, '([^,;]*),[^;]*;') do
  n = n + 1
  slots[n] = slot
end

slots[n + 1] = HASHTABLE_FIELD
local holders = redis.call('HMGET', live_key, unpack(slots))
slots[n + 1] = nil
local has_live = holders[n + 1] ~= false
local live_expires, live_due = read_live_marker(holders[n + 1] or nil)

-- Delivered when the slot's lease runs and the entry names no request or the holder's; request
-- ids are only looked at when sent. A holder is "<deadline stamp>|<request id>", so comparing
-- the whole value with the stamp of now + 1 ms is "deadline > now" without cutting it out: an
-- equal stamp wins by being longer, an earlier one loses on its digits. Lua compares strings
-- with strcoll, under the collation the server was started with: the right-hand side is digits
-- only, so the answer is the same in every locale (now's stamp followed by '~' was not: in
-- en_US.UTF-8 punctuation weighs nothing, and a lease counted as running at its deadline).
local now16 = ms16(now)
local next16 = ms16(now + 1)
local with_rids = ARGV[8] == '1'
local buffered = {}
local nbuffered = 0
local cursor = 1 -- where entry i starts in packed, followed only when request ids were sent
for i = 1, n do
  local holder = holders[i]
  local delivered = holder and holder > next16
  if with_rids then
    local rid_at = find(packed, ',', cursor + #slots[i] + 1, true) + 1
    local stop = find(packed, ';', rid_at, true)
    if delivered then
      local rid = sub(packed, rid_at, stop - 1)
      delivered = rid == '' or rid == sub(holder, 18)
    end
    cursor = stop + 1
  end
  if not delivered then
    nbuffered = nbuffered + 1
    buffered[nbuffered] = i
  end
end

-- The common path ends here: every entry delivered and, by the live marker, nothing due.
if nbuffered == 0 and live_due ~= nil and live_due > now16 then
  count(stats_key, 'delivered', n)
  return remember_reply(reply_key, 'ok|' .. now16 .. '|' .. string.rep('D', n), ARGV[5])
end

-- @helpers: the library helpers only the code below uses are created here (see scripts.py).

local at = fmt(now)
local ttl = tonumber(ARGV[3])
local deadline = now + ttl
local superseded = 0
local limit = ARGV[6] -- as sent: sweep converts it when it runs
if nbuffered == 0 then
  -- Only delivering, and something may be due: sweep, then move the live marker on.
  sweep(pending_key, expiry_key, stats_key, now, limit)
  if has_live then
    redis.call('HSET', live_key, HASHTABLE_FIELD, live_marker(live_expires or ZERO16, earliest_due(expiry_key)))
  end
else
  local injected = ARGV[1] ~= ''
  -- Distinct slots in first-seen order; a slot twice in one batch keeps its newest entry.
  local index, order = {}, {}
  local norder = 0
  for k = 1, nbuffered do
    local slot = slots[buffered[k]]
    if not index[slot] then
      norder = norder + 1
      order[norder] = slot
      index[slot] = norder
    end
  end
  order[norder + 1] = HASHTABLE_FIELD
  local values = redis.call('HMGET', pending_key, unpack(order))
  local meta = read_meta(values[norder + 1])
  if sweep_if_due(pending_key, expiry_key, stats_key, now, now16, limit, meta) then
    values = redis.call('HMGET', pending_key, unpack(order))
    meta = read_meta(values[norder + 1])
  end
  order[norder + 1] = nil
  local changed = meta == nil
  local ttl16 = ms16(ttl)
  if meta == nil then
    -- A hash without a marker is new (or older than markers): index every slot, sweep soon.
    local existed = redis.call('EXISTS', pending_key) == 1
    meta = {longest = ttl16, due = existed and ZERO16 or FAR16, expires = ZERO16}
  end
  -- A slot that holds records has its group indexed no later than its earliest deadline; with
  -- the server's clock and no TTL longer than the rank's longest so far, this record's deadline
  -- is not earlier, so only new slots need a ZADD. An injected clock may go back: always ZADD.
  local all_new = injected or changed or ttl16 > meta.longest
  local marker = ';' .. layer .. ','
  local dl = fmt(deadline)
  local suffix = ',' .. at .. ',' .. dl
  local hset, zadd, groups = {}, {'LT'}, {}
  local nzadd = 1
  for j = 1, norder do
    if all_new or not values[j] then
      local group = math.floor(tonumber(order[j]) / EXPIRY_GROUP)
      if not groups[group] then
        groups[group] = true
        zadd[nzadd + 1] = dl
        zadd[nzadd + 2] = fmt(group)
        nzadd = nzadd + 2
      end
    end
  end
  -- Entry i's "tokens,request_id" follows its slot and a ',', up to its ';': packed is walked
  -- once, one find per entry.
  local start_at, next_i = 1, 1 -- entry next_i starts at start_at
  for k = 1, nbuffered do
    local i = buffered[k]
    while next_i < i do
      start_at = find(packed, ';', start_at, true) + 1
      next_i = next_i + 1
    end
    local slot = slots[i]
    local from = start_at + #slot + 1
    local stop = find(packed, ';', from, true)
    start_at, next_i = stop + 1, i + 1
    local j = index[slot]
    local value = values[j]
    local rec = marker .. sub(packed, from, stop - 1) .. suffix
    if not value then
      values[j] = rec
    else
      local start = find(value, marker, 1, true)
      if start == 1 and not find(value, ';', 2, true) then
        values[j] = rec -- the slot's only record, replaced
        superseded = superseded + 1
      elseif start then
        local stop = find(value, ';', start + 1, true)
        if stop then
          values[j] = sub(value, 1, start - 1) .. rec .. sub(value, stop)
        else
          values[j] = sub(value, 1, start - 1) .. rec
        end
        superseded = superseded + 1
      else
        values[j] = value .. rec
      end
    end
  end
  for j = 1, norder do
    hset[2 * j - 1] = order[j]
    hset[2 * j] = values[j]
  end
  if ttl16 > meta.longest then
    meta.longest = ttl16
    changed = true
  end
  if nzadd > 1 then
    local deadline16 = ms16(deadline)
    if deadline16 < meta.due then
      meta.due = deadline16
      changed = true
    end
  end
  -- The expiry index lives and dies with the pending hash: their TTLs are refreshed together.
  local key_ttl = tonumber(ARGV[4])
  local refresh, expires = ttl_refresh(pending_key, meta.expires, now, injected, key_ttl, ttl)
  if expires ~= meta.expires then
    meta.expires = expires
    changed = true
  end
  if changed then
    hset[2 * norder + 1] = HASHTABLE_FIELD
    hset[2 * norder + 2] = encode_meta(meta)
  end
  redis.call('HSET', pending_key, unpack(hset))
  if nzadd > 1 then
    redis.call('ZADD', expiry_key, unpack(zadd))
  end
  if refresh then
    redis.call('PEXPIRE', pending_key, key_ttl)
    redis.call('PEXPIRE', expiry_key, key_ttl)
  end
  -- The live marker's next due may not be later than the index's earliest score.
  if has_live and (live_due == nil or meta.due < live_due) then
    redis.call('HSET', live_key, HASHTABLE_FIELD, live_marker(live_expires or ZERO16, meta.due))
  end
end

-- "recorded" is delivered + buffered, added up when the counters are read.
count(stats_key, 'delivered', n - nbuffered)
count(stats_key, 'buffered', nbuffered)
count(stats_key, 'superseded', superseded)

-- Flags: one per entry, D unless its index is in buffered.
local flags
if nbuffered == n then
  flags = string.rep('B', n)
else
  local each = {}
  for i = 1, n do
    each[i] = 'D'
  end
  for k = 1, nbuffered do
    each[buffered[k]] = 'B'
  end
  flags = table.concat(each)
end
return remember_reply(reply_key, 'ok|' .. now16 .. '|' .. flags, ARGV[5])
