#!lua name=rls_v2
-- _lib.lua: the start of the rls_v2 Functions library, the helpers every function shares.
--
-- redis_layer_signals/server/library.py joins this file and record.lua, register.lua,
-- finish.lua, sweep.lua, apply.lua and claim.lua (then permissions.lua and digest.lua), in that
-- order, into one library, loaded once per server with FUNCTION LOAD and called with FCALL
-- rls_v2_<operation>_<digest> (see DIGEST below). The "v2" in both names is the library's
-- version: a release that changes what a function does loads under a new name, so two client
-- releases never replace each other's functions on a shared server.
-- A release that also changes how the keys are laid out must version its key names too
-- (nothing released uses another layout).
--
-- Loading runs this code once, and Redis 7.0 refuses any global (string, math, table, unpack,
-- redis.call) while it does: top-level code only declares locals and registers functions, and
-- every library call happens inside a function, when it runs.
--
-- Keys of one instance and rank, all under the hash tag {namespace/instance/rank}; every one
-- comes in the call's keys, none is built here:
--
--   live     hash    "<slot>" -> "<lease deadline ms, 16 digits>|<request id>";
--                    "<slot>:doc" -> task document; "<slot>:recovery" -> register's first
--                    payload; '~' (see HASHTABLE_FIELD)
--   pending  hash    "<slot>:<layer>" -> "<tokens>,<request id>,<recorded at ms>,<deadline ms>"
--                    (request id empty when unknown), one field per pending signal;
--                    "layers" -> ",<layer>,<layer>,...,": every layer buffered on the rank since
--                    the hash was created, ascending; '~' (see HASHTABLE_FIELD)
--   expiry   zset    "<slot // 8>" -> at or before the earliest pending deadline of those 8 slots
--   stats    hash    counters (the only key without a TTL)
--   reply    string  one call's reply, under its idempotency token
--   ended    hash    "<slot>" -> "<finished at ms>|<request id>": the slot's latest finish
--                    (finish.lua writes it, a replayed record reads it)
--   writer   string  "<batch>|<reply>": the last batch one bridge process applied (apply.lua)
--   identity string  "<token>|<host>|<pid>|<pid namespace>|<claimed at ms>|<lease until ms>|
--                    <generation>": the claim of the bridge process that owns the rank
--                    (claim.lua); kept past its lease, so that the next owner learns whom it
--                    replaced
--   clash    string  "<token>|<host>|<pid>|<pid namespace>|<at ms>|<write or claim>": the last
--                    process refused by the fence (see owner_fence), for the owner to log
--
-- record writes each signal blind into its own field, so its cost does not depend on what the
-- slot already holds; HSET's reply (fields created) tells how many replaced an older signal.
-- register, finish and the sweep read a slot's signals as one HMGET of "<slot>:<layer>" for
-- the rank's layers. Numbers are compared as numbers (tonumber), with one exception: record
-- compares a whole live entry with a 16-digit stamp (see record.lua), digits against digits,
-- which gives the same answer under any collation the server runs with (Lua compares strings
-- with strcoll; tests/test_collation.py runs the functions under en_US.UTF-8).

-- The library's digest: the SHA-256 of this code as the files stand, with the placeholder
-- below in place; server/library.py puts the digest in its place when it builds the library. Every
-- function is registered as rls_v2_<operation>_<digest>, so a client calls only the code it
-- ships: an rls_v2 built from other code has other function names, and the call is answered
-- "Function not found" without running anything. rls_v2_digest (digest.lua) reports it.
local DIGEST = '@DIGEST@'

local EXPIRY_GROUP = 8

-- live and pending, the hashes read by multi-field HMGETs, carry the field '~' whose value is
-- longer than hash-max-listpack-value (64 by default). Redis then keeps them in hashtable
-- encoding, where each field HMGET asks for is one lookup. In listpack encoding, which Redis
-- keeps up to hash-max-listpack-entries fields (128 by default, 512 in Debian's Redis 7.0),
-- each field is a scan of the hash: record of 512 delivered entries measured 1,380 us of
-- server time per call without the field and 310 us with it. Readers skip the field (its
-- name is no slot); a hash holding only it (and "layers") is deleted.
local HASHTABLE_FIELD = '~'
local HASHTABLE_VALUE = 'present so that this hash stays hashtable-encoded: HMGET is one lookup per field'
local UNPACK_CHUNK = 4000 -- arguments per command, well under Lua's C stack limit

local function fmt(n)
  return string.format('%d', n)
end

-- Milliseconds now: the client's clock when it sent one (tests), else the server's TIME.
local function now_ms(arg)
  if arg ~= nil and arg ~= '' then
    return tonumber(arg)
  end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Add n to a counter of the rank (nothing to write for 0).
local function count(stats_key, field, n)
  if n > 0 then
    redis.call('HINCRBY', stats_key, field, n)
  end
end

-- Idempotency: the first reply of this call when a resend of it already ran (counted as
-- replayed), else nil. Every operation starts with this check.
local function replayed_reply(reply_key, stats_key)
  local cached = redis.call('GET', reply_key)
  if cached then
    redis.call('HINCRBY', stats_key, 'replayed', 1)
  end
  return cached
end

-- Keep a reply under the call's token for as long as a resend may come, and return it.
local function remember_reply(reply_key, reply, ttl_ms)
  redis.call('SET', reply_key, reply, 'PX', ttl_ms)
  return reply
end

-- Milliseconds as a 16-digit, zero-padded stamp: how live entries store lease deadlines.
local function ms16(ms)
  return string.format('%016d', ms)
end

-- A slot's live entry, "<lease deadline ms, 16 digits>|<request id>": the request id and
-- whether its lease still runs at now (nil, false when the slot has no entry).
local function holder(value, now)
  if not value then
    return nil, false
  end
  return string.sub(value, 18), tonumber(string.sub(value, 1, 16)) > now
end

-- HMGET of any number of fields, in chunks; missing fields are false, as HMGET returns them.
local function hmget(key, fields)
  local values = {}
  for first = 1, #fields, UNPACK_CHUNK do
    local last = math.min(first + UNPACK_CHUNK - 1, #fields)
    local part = redis.call('HMGET', key, unpack(fields, first, last))
    for i = 1, #part do
      values[first + i - 1] = part[i]
    end
  end
  return values
end

local function hdel(key, fields)
  for first = 1, #fields, UNPACK_CHUNK do
    redis.call('HDEL', key, unpack(fields, first, math.min(first + UNPACK_CHUNK - 1, #fields)))
  end
end

-- The layers buffered on the rank (strings, ascending), from the pending hash's "layers".
local function pending_layers(pending_key)
  local layers = {}
  local list = redis.call('HGET', pending_key, 'layers')
  if list then
    for layer in string.gmatch(list, '[^,]+') do
      layers[#layers + 1] = layer
    end
  end
  return layers
end

-- Add a layer to "layers" unless it is there: one find on a call that buffers; the list is
-- rewritten only the first time a layer is buffered on the rank.
local function note_layer(pending_key, layer)
  local list = redis.call('HGET', pending_key, 'layers') or ','
  if string.find(list, ',' .. layer .. ',', 1, true) then
    return
  end
  local layers = pending_layers(pending_key)
  layers[#layers + 1] = layer
  table.sort(layers, function(a, b) return tonumber(a) < tonumber(b) end)
  -- The hash's first layer creates it: the encoding field comes with the list.
  redis.call('HSET', pending_key, 'layers', ',' .. table.concat(layers, ',') .. ',', HASHTABLE_FIELD, HASHTABLE_VALUE)
end

-- The fields of one slot's pending signals, one per layer of the rank.
local function slot_fields(slot, layers)
  local fields = {}
  for i, layer in ipairs(layers) do
    fields[i] = slot .. ':' .. layer
  end
  return fields
end

-- A pending signal's value as tokens, request id, recorded at and deadline (strings).
local function parse_signal(value)
  return string.match(value, '^([^,]*),([^,]*),([^,]*),([^,]*)$')
end

-- When no signal is pending any more (only "layers" and '~' are left), remove the pending hash
-- and its expiry index, so a quiet rank leaves no keys. An index score left early by a pop is only a
-- visit the sweep makes for nothing, and the sweep then writes the exact score back.
local function drop_pending_if_empty(pending_key, expiry_key)
  if redis.call('HLEN', pending_key) <= 2 then
    redis.call('DEL', pending_key, expiry_key)
  end
end

-- Refresh the TTL of a key, and of its partner that lives and dies with it (nil: none), once
-- less than ttl plus half the grace (key_ttl - ttl) is left. It only ever lengthens them: a key
-- kept longer by another buffer's longer TTL keeps its TTL.
local function keep_alive(key, partner, ttl, key_ttl)
  if redis.call('PTTL', key) < ttl + math.floor((key_ttl - ttl) / 2) then
    redis.call('PEXPIRE', key, key_ttl)
    if partner then
      redis.call('PEXPIRE', partner, key_ttl)
    end
  end
end

-- The ownership fence: one identity, one owner. Every write an owner makes (apply, a claim's
-- renewal) carries its claim, the token and generation claim.lua gave it, and calls this before
-- writing anything. held is the claim Redis holds, "<token>|...|<generation>" (the identity key's
-- value), nil when none. True when the caller may write: no claim is held (the next renewal
-- claims it again), the caller holds it, or the held one is older than the caller's (generations
-- only grow). False: another process claimed the identity after the caller did; the caller writes
-- nothing of the owner's and replies "fenced|<now>|<held claim>", after note_clash.
local function owner_fence(held, token, generation)
  if not held then
    return true
  end
  if string.match(held, '^([^|]*)|') == token then
    return true
  end
  return (tonumber(string.match(held, '|(%d+)$')) or 0) < tonumber(generation)
end

-- A process refused the rank (by the fence, or a claim refused), noted for the owner: counted
-- under counter, and kept in the clash key, which the owner's next renewal reads and logs
-- (claim.lua). who is "<token>|<host>|<pid>|<pid namespace>"; what is "write" or "claim".
local function note_clash(clash_key, stats_key, counter, who, now, what, kept_ms)
  redis.call('HINCRBY', stats_key, counter, 1)
  redis.call('SET', clash_key, who .. '|' .. fmt(now) .. '|' .. what, 'PX', kept_ms)
end

-- Count and remove pending signals whose deadline has passed. Visits at most `limit_arg`
-- slots' worth of groups that held expired signals, plus early-scored groups that turn out to
-- hold none (each rescored or removed), never more than the due page it fetched. Each group
-- costs one HMGET of its 8 slots' fields for the rank's layers.
local function sweep(pending_key, expiry_key, stats_key, now, limit_arg)
  local limit = tonumber(limit_arg)
  if limit <= 0 then
    return 0
  end
  local group_limit = math.ceil(limit / EXPIRY_GROUP)
  local due = redis.call('ZRANGEBYSCORE', expiry_key, '-inf', now, 'LIMIT', 0, group_limit * EXPIRY_GROUP)
  if #due == 0 then
    return 0
  end
  local layers = pending_layers(pending_key)
  local expired, worked = 0, 0
  for _, group in ipairs(due) do
    if worked >= group_limit then
      break
    end
    local fields = {}
    local first = tonumber(group) * EXPIRY_GROUP
    for slot = first, first + EXPIRY_GROUP - 1 do
      for _, field in ipairs(slot_fields(fmt(slot), layers)) do
        fields[#fields + 1] = field
      end
    end
    local values = hmget(pending_key, fields)
    local gone, earliest = {}, nil
    for i = 1, #fields do
      if values[i] then
        local _, _, _, deadline = parse_signal(values[i])
        local ms = tonumber(deadline)
        if ms <= now then
          gone[#gone + 1] = fields[i]
        elseif earliest == nil or ms < earliest then
          earliest = ms
        end
      end
    end
    if #gone > 0 then
      hdel(pending_key, gone)
      expired = expired + #gone
      worked = worked + 1
    end
    if earliest == nil then
      redis.call('ZREM', expiry_key, group)
    else
      redis.call('ZADD', expiry_key, earliest, group)
    end
  end
  drop_pending_if_empty(pending_key, expiry_key)
  count(stats_key, 'expired', expired)
  return expired
end
