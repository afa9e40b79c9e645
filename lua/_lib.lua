-- _lib.lua: helpers shared by every operation script.
--
-- The loader prepends this file to each operation script before it registers the script, so
-- one SHA covers helpers and body. It defines local functions only: no KEYS, no ARGV, no reply,
-- no writes of its own. Every key it touches is handed in by the caller, which got it from KEYS.
--
-- Pending signals of one slot live in one field of the rank's pending hash, packed as records
-- "layer,tokens,request_id,recorded_at_ms,deadline_ms;" (request_id empty when unknown).
-- Numbers that came from the client stay strings, so values up to 2^53 survive untouched
-- (Lua 5.1 prints large numbers in %.14g); computed numbers are printed with %d.

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

local function parse_pending(value)
  local records = {}
  if not value then
    return records
  end
  for layer, tokens, rid, at, deadline in string.gmatch(value, '([^,;]*),([^,;]*),([^,;]*),([^,;]*),([^,;]*);') do
    records[#records + 1] = {layer = layer, tokens = tokens, rid = rid, at = at, deadline = tonumber(deadline)}
  end
  return records
end

local function encode_pending(records)
  local parts = {}
  for i, rec in ipairs(records) do
    parts[i] = rec.layer .. ',' .. rec.tokens .. ',' .. rec.rid .. ',' .. rec.at .. ',' .. fmt(rec.deadline) .. ';'
  end
  return table.concat(parts)
end

local function earliest_deadline(records)
  local earliest = records[1].deadline
  for i = 2, #records do
    if records[i].deadline < earliest then
      earliest = records[i].deadline
    end
  end
  return earliest
end

-- Extend a key's TTL to at least ttl_ms; never shortens it (PEXPIRE GT needs Redis 7).
local function extend_ttl(key, ttl_ms)
  local current = redis.call('PTTL', key)
  if current ~= -2 and current < ttl_ms then
    redis.call('PEXPIRE', key, ttl_ms)
  end
end

-- Holder of a slot from the rank's live hash: request id and whether its lease still runs.
local function parse_holder(value, now)
  if not value then
    return nil, false
  end
  local rid, deadline = string.match(value, '^([^|]*)|(%d+)$')
  return rid, tonumber(deadline) > now
end

-- Write back one slot's pending records (or remove the slot) and keep the expiry index true.
local function store_pending(pending_key, expiry_key, slot, records)
  if #records == 0 then
    redis.call('HDEL', pending_key, slot)
    redis.call('ZREM', expiry_key, slot)
  else
    redis.call('HSET', pending_key, slot, encode_pending(records))
    redis.call('ZADD', expiry_key, earliest_deadline(records), slot)
  end
end

-- Count and remove pending signals whose deadline has passed, at most `limit` slots per run so
-- a script never loops over more than it was asked to.
local function sweep(pending_key, expiry_key, stats_key, now, limit)
  if limit <= 0 then
    return 0
  end
  local due = redis.call('ZRANGEBYSCORE', expiry_key, '-inf', now, 'LIMIT', 0, limit)
  local expired = 0
  for _, slot in ipairs(due) do
    local kept = {}
    for _, rec in ipairs(parse_pending(redis.call('HGET', pending_key, slot))) do
      if rec.deadline <= now then
        expired = expired + 1
      else
        kept[#kept + 1] = rec
      end
    end
    store_pending(pending_key, expiry_key, slot, kept)
  end
  if expired > 0 then
    redis.call('HINCRBY', stats_key, 'expired', expired)
  end
  return expired
end

local function count(stats_key, field, n)
  if n > 0 then
    redis.call('HINCRBY', stats_key, field, n)
  end
end

