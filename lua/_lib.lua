-- _lib.lua: helpers shared by every operation script.
--
-- The loader (redis_layer_signals/scripts.py) sends each operation script with the definitions
-- of this file it uses, so one SHA covers helpers and body; each top-level `local` is one
-- definition, with the comment just above it. It defines locals only: no KEYS, no ARGV, no
-- reply, no writes of its own. Every key it touches is handed in by the caller, which got it
-- from KEYS.
--
-- Pending signals of one slot live in one field of the rank's pending hash, packed as records
-- ";layer,tokens,request_id,recorded_at_ms,deadline_ms" in arrival order (request_id empty when
-- unknown). The leading ';' lets record find a slot's layer with one plain string.find and
-- append or splice without decoding the other records: a record copies its slot's field once
-- (bytes that grow with the slot's layers) and parses none of it. Numbers that came from the
-- client stay strings, so values up to 2^53 survive untouched (Lua 5.1 prints large numbers in
-- %.14g); computed numbers are printed with %d.
--
-- Hashes that scripts read with one HMGET per batch (live, pending) are created with the
-- HASHTABLE field below: its value is longer than hash-max-listpack-value, so Redis keeps them
-- in hashtable encoding, where HMGET costs O(1) per field instead of a scan of the listpack.
-- In the pending hash the marker's value is "<longest TTL>|<next due>|<key expires at>|...",
-- each a 16-digit stamp (see ms16):
-- while a record uses no longer TTL, a slot that already holds records needs no expiry ZADD;
-- a call before <next due> (at or before the expiry index's earliest score) skips the sweep;
-- a call well before <key expires at> (0 under an injected clock) skips the PTTL. The live
-- hash's marker is "<key expires at>|<next due>|...", stamps too: a record that only delivers
-- reads it in the HMGET it makes anyway and sweeps only once something may be due. Both
-- <next due> stay at or before the index's earliest score: only record adds scores, and it
-- lowers both markers.
--
-- The expiry zset indexes groups of EXPIRY_GROUP slots (member: slot // EXPIRY_GROUP), scored
-- by a time at or before the group's earliest pending deadline. Groups, not slots, keep the
-- zset small (listpack-encoded for up to 1024 slots); a score left early by a pop is only a
-- visit the sweep makes for nothing, and the sweep then writes the exact score back.

local find, sub, format = string.find, string.sub, string.format

local HASHTABLE_FIELD = '~'
local HASHTABLE_VALUE = 'kept longer than hash-max-listpack-value (64) so HMGET stays O(1) per field'
local EXPIRY_GROUP = 8

local function fmt(n)
  return format('%d', n)
end

-- Milliseconds now: the client's clock when it sent one (tests), else the server's TIME.
local function now_ms(arg)
  if arg ~= nil and arg ~= '' then
    return tonumber(arg)
  end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- The records of one slot's packed value, one per step of a generic for, cut out with plain
-- finds (no pattern matching, no table per record):
--   for after, layer, tokens, rid, at, deadline in records(value) do ... end
-- The first value is where the next record starts, so a record that starts at `from` is
-- sub(value, from - 1, after - 2) with its ';'; the rest are strings.
local function next_record(value, from)
  if from > #value then
    return nil
  end
  local c1 = find(value, ',', from, true)
  local c2 = find(value, ',', c1 + 1, true)
  local c3 = find(value, ',', c2 + 1, true)
  local c4 = find(value, ',', c3 + 1, true)
  local stop = find(value, ';', c4 + 1, true) or #value + 1
  return stop + 1, sub(value, from, c1 - 1), sub(value, c1 + 1, c2 - 1), sub(value, c2 + 1, c3 - 1),
    sub(value, c3 + 1, c4 - 1), sub(value, c4 + 1, stop - 1)
end

local function records(value)
  return next_record, value or '', 2
end

-- Milliseconds as a 16-digit, zero-padded stamp: lease deadlines and marker times are stored
-- so, and such strings compare as the numbers they hold. A check is then one sub and one
-- string comparison; tonumber and format are the dearest steps of a small script.
local function ms16(ms)
  return format('%016d', ms)
end

local ZERO16, FAR16 = '0000000000000000', '9007199254740991'

-- Remove a hash that only holds the encoding marker, so a released rank leaves no keys (the
-- scripts create these hashes with the marker, so one field left is the marker).
local function drop_if_empty(key, also)
  if redis.call('HLEN', key) <= 1 then
    if also then
      redis.call('DEL', key, also)
    else
      redis.call('DEL', key)
    end
  end
end

-- Holder of a slot from the rank's live hash, "<lease deadline stamp>|<request id>": the
-- request id and whether its lease still runs (now16: the current time as a stamp). An entry
-- of the layout before, "<request id>|<lease deadline stamp>", is read as such (else its
-- first bytes compare above every stamp: a lease that never ends, held by no request).
local function parse_holder(value, now16)
  if not value then
    return nil, false
  end
  if not find(value, '^%d%d%d%d%d%d%d%d%d%d%d%d%d%d%d%d|') then
    return sub(value, 1, -18), sub(value, -16) > now16
  end
  return sub(value, 18), sub(value, 1, 16) > now16
end

-- Remove one slot's pending field; when the rank has no pending signals left, drop the hash
-- and its expiry index. A group score left early is fixed by the next sweep that reaches it.
local function clear_pending(pending_key, expiry_key, slot)
  redis.call('HDEL', pending_key, slot)
  drop_if_empty(pending_key, expiry_key)
end

-- Write back one slot's remaining records, packed (finish keeps other requests' signals).
local function store_pending(pending_key, expiry_key, slot, packed)
  if packed == '' then
    clear_pending(pending_key, expiry_key, slot)
  else
    redis.call('HSET', pending_key, slot, packed)
  end
end

-- Add n to a counter of the rank (nothing to write for 0).
local function count(stats_key, field, n)
  if n > 0 then
    redis.call('HINCRBY', stats_key, field, n)
  end
end

-- Count and remove pending signals whose deadline has passed. Visits at most `limit_arg`
-- slots' worth of groups that held expired signals, plus early-scored groups that turn out to
-- hold none (each one HMGET, then rescored or removed), never more than the due page it
-- fetched. `limit_arg` is the script argument as sent, a decimal string, converted here: the
-- calls that could sweep but do not (most of them) pay no tonumber for it.
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
  local expired, worked = 0, 0
  for _, group in ipairs(due) do
    if worked >= group_limit then
      break
    end
    local first = tonumber(group) * EXPIRY_GROUP
    local fields = {}
    for s = 0, EXPIRY_GROUP - 1 do
      fields[s + 1] = fmt(first + s)
    end
    local values = redis.call('HMGET', pending_key, unpack(fields))
    local earliest = nil
    local group_expired = 0
    for s = 1, EXPIRY_GROUP do
      if values[s] then
        local value, kept, gone, from = values[s], {}, 0, 2
        for after, _, _, _, _, deadline in records(value) do
          local ms = tonumber(deadline)
          if ms <= now then
            gone = gone + 1
          else
            kept[#kept + 1] = sub(value, from - 1, after - 2)
            if earliest == nil or ms < earliest then
              earliest = ms
            end
          end
          from = after
        end
        if gone > 0 then
          group_expired = group_expired + gone
          if #kept == 0 then
            redis.call('HDEL', pending_key, fields[s])
          else
            redis.call('HSET', pending_key, fields[s], table.concat(kept))
          end
        end
      end
    end
    if earliest == nil then
      redis.call('ZREM', expiry_key, group)
    else
      redis.call('ZADD', expiry_key, earliest, group)
    end
    if group_expired > 0 then
      worked = worked + 1
      expired = expired + group_expired
    end
  end
  drop_if_empty(pending_key, expiry_key)
  count(stats_key, 'expired', expired)
  return expired
end

-- The expiry index's earliest score as a stamp, FAR16 when nothing is indexed: what a marker's
-- <next due> becomes after a sweep.
local function earliest_due(expiry_key)
  local first = redis.call('ZRANGE', expiry_key, 0, 0, 'WITHSCORES')
  return first[2] and ms16(tonumber(first[2])) or FAR16
end

-- Whether a key's TTL (and its partners') is due for a refresh, once half the grace beyond the
-- longest TTL it holds is used, and the marker's new <key expires at>: expires16 is the
-- marker's (nil when there is none). Under an injected clock a PTTL decides and the marker
-- keeps zeros.
local function ttl_refresh(key, expires16, now, injected, key_ttl, ttl)
  local floor_ttl = key_ttl - math.floor((key_ttl - ttl) / 2)
  if injected then
    return redis.call('PTTL', key) < floor_ttl, ZERO16
  end
  if expires16 ~= nil and expires16 >= ms16(now + floor_ttl) then
    return false, expires16
  end
  return true, ms16(now + key_ttl)
end

-- The pending hash's marker as stamps {longest, due, expires}, or nil when it has none. A marker
-- this version did not write (an older layout) reads as all zeros: a sweep is due now, which
-- rewrites it, and every slot is indexed and the TTL refreshed, as for a new hash. Reading it
-- as none would let register give the live marker a far-future <next due> (no sweep ever).
local function read_meta(value)
  if not value then
    return nil
  end
  if sub(value, 17, 17) ~= '|' or sub(value, 34, 34) ~= '|' or sub(value, 51, 51) ~= '|' then
    return {longest = ZERO16, due = ZERO16, expires = ZERO16}
  end
  return {longest = sub(value, 1, 16), due = sub(value, 18, 33), expires = sub(value, 35, 50)}
end

local function encode_meta(meta)
  return meta.longest .. '|' .. meta.due .. '|' .. meta.expires .. '|' .. HASHTABLE_VALUE
end

-- Sweep only when the marker says a deadline may have passed, then write the index's new
-- earliest score into the marker. No marker: no pending hash (record creates both together,
-- and the expiry index lives and dies with it), so nothing to expire. Returns whether it
-- swept, so the caller reads again what the sweep may have changed.
local function sweep_if_due(pending_key, expiry_key, stats_key, now, now16, limit, meta)
  if meta == nil or meta.due > now16 then
    return false
  end
  sweep(pending_key, expiry_key, stats_key, now, limit)
  meta.due = earliest_due(expiry_key)
  if redis.call('EXISTS', pending_key) == 1 then
    redis.call('HSET', pending_key, HASHTABLE_FIELD, encode_meta(meta))
  end
  return true
end

-- One slot's pending field and the pending hash's marker, read again after a sweep when one
-- was due (the sweep may have removed the slot's expired records). register and finish start
-- here; meta is nil when the rank has no pending hash.
local function slot_pending(pending_key, expiry_key, stats_key, slot, now, now16, limit)
  local found = redis.call('HMGET', pending_key, slot, HASHTABLE_FIELD)
  local stored, meta = found[1], read_meta(found[2])
  if sweep_if_due(pending_key, expiry_key, stats_key, now, now16, limit, meta) then
    stored = redis.call('HGET', pending_key, slot)
  end
  return stored, meta
end

-- The live hash's marker as stamps: when the key expires and when a sweep may be due; nils
-- when absent (or not written by this version).
local function read_live_marker(value)
  if not value or sub(value, 17, 17) ~= '|' or sub(value, 34, 34) ~= '|' then
    return nil, nil
  end
  return sub(value, 1, 16), sub(value, 18, 33)
end

local function live_marker(expires16, due16)
  return expires16 .. '|' .. due16 .. '|' .. HASHTABLE_VALUE
end

-- Idempotency: the first reply of this call when a resend of it already ran (counted as
-- replayed), else nil. Every operation script starts with this check.
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
