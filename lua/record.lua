-- record.lua: FCALL rls_v2_record_<digest>, deliver or buffer one batch of layer signals of one
-- instance and rank.
--
-- keys[1] live     hash    slot -> "<lease deadline ms, 16 digits>|<request id>"; '~' (see _lib.lua)
-- keys[2] pending  hash    "<slot>:<layer>" -> pending signal; "layers" (see _lib.lua)
-- keys[3] expiry   zset    slot group -> at or before its earliest pending deadline
-- keys[4] stats    hash    counters (no TTL)
-- keys[5] reply    string  this call's idempotency token: the reply, kept reply_ttl_ms
-- keys[6] ended    hash    slot -> "<finished at ms>|<request id>": the slot's latest finish
-- args[1] now_ms: the time the call decides at (empty: server TIME); a replay passes the time
--         the signals were first recorded at, on the server's clock
-- args[2] layer
-- args[3] pending_ttl_ms                   args[4] pending key TTL in ms (pending_ttl + grace)
-- args[5] reply_ttl_ms                     args[6] sweep limit (slots per run)
-- args[7] the entries' slots, "slot," per entry
-- args[8] "1" when some entry carries a request id, else "0"
-- args[9] the rest of each entry, "tokens,request_id;" in the same order (request_id empty
--         when unknown). Apart from the slots: a batch that is all delivered never reads it.
-- args[10] task_ttl_ms of the holders, given with a time of the caller's (args[1]: a replay,
--         or a call sent late, may decide in the past); empty with the server's TIME. A
--         holder registered (its lease deadline minus this) at or after the signals' deadline
--         came too late for them: they are buffered as of args[1], already expired, and the
--         next sweep counts them expired. A slot finished after args[1]
--         (`ended`) ended the signal: it is counted buffered and finish_dropped, as that
--         finish would have counted it, and neither delivered nor kept (the slot may hold the
--         next request by now).
--
-- Reply: "ok|<now ms>|<flags>", one flag per entry in order: D delivered (the slot has a live
-- task of this request, or of any request when the signal carries none), B buffered.
--
-- Guarantees: the liveness check and the buffering happen in this one function, so a signal
-- is either delivered here or buffered, never both and never neither. A resend with the same
-- token returns the first reply and writes nothing new. One pending signal per slot and layer:
-- the newest wins and the one it replaces is counted as superseded (also within one batch),
-- from HSET's count of created fields. Counters: delivered, buffered, superseded ("recorded"
-- is the first two summed by the reader), and finish_dropped for a replayed signal a later
-- finish ended. Whatever the slot holds already, a buffered entry
-- costs one field in one HSET: no read of the slot's other layers.

-- The rests of a batch's entries, "tokens,request_id" each, from args[9] ("...;" per entry).
local function split_rests(packed)
  local rests = {}
  for rest in string.gmatch(packed, '[^;]+') do
    rests[#rests + 1] = rest
  end
  return rests
end

-- A replay: whether the slot's latest finish ("<finished at>|<request id>", or false) came
-- after now and ended a signal whose rest is "tokens,request_id": one of its request, or
-- naming none, as finish.lua drops them.
local function ended_by(finish, rest, now)
  local bar = string.find(finish, '|', 1, true)
  if tonumber(string.sub(finish, 1, bar - 1)) <= now then
    return false
  end
  local rid = string.sub(rest, string.find(rest, ',', 1, true) + 1)
  return rid == '' or rid == string.sub(finish, bar + 1)
end

local function record(keys, args)
  local live_key, pending_key, expiry_key, stats_key, reply_key = keys[1], keys[2], keys[3], keys[4], keys[5]
  local ended_key = keys[6]

  local cached = replayed_reply(reply_key, stats_key)
  if cached then
    return cached
  end

  local find, sub = string.find, string.sub -- locals: the loops below use them per entry
  local now = now_ms(args[1])
  local layer = args[2]
  -- The entries' slots. The rest of each entry, "tokens,request_id" (the start of its stored
  -- value), comes in its own argument, split only when request ids are compared or something
  -- is buffered: a batch that is all delivered costs one string per entry, not two.
  local slots = {}
  local n = 0
  for slot in string.gmatch(args[7], '[^,]+') do
    n = n + 1
    slots[n] = slot
  end

  -- Expired signals are counted before anything replaces them.
  sweep(pending_key, expiry_key, stats_key, now, args[6])

  -- Delivered when the slot's lease runs and the entry names no request (its rest ends with
  -- the comma) or the holder's. A live entry starts with its lease deadline as 16 digits,
  -- "<deadline>|<request id>", so "deadline > now" is the whole entry compared with the stamp
  -- of now + 1 ms: an earlier deadline loses on its digits, an equal one wins by being longer.
  -- Both sides start with 16 digits, so the answer is the same under any server collation.
  -- No string is cut per entry, and request ids are looked at only when the batch has some.
  local holders = redis.call('HMGET', live_key, unpack(slots))
  local next16, with_rids = ms16(now + 1), args[8] == '1'
  local rests = with_rids and split_rests(args[9]) or nil
  -- A replay: a holder whose lease ends at or after this stamp registered after the signals'
  -- deadline (lease deadline = registered at + task TTL), too late for them.
  local late16 = args[10] ~= nil and args[10] ~= '' and ms16(now + tonumber(args[3]) + tonumber(args[10])) or nil
  -- A replay: the slot's latest finish, when it came after the signals (and was of their
  -- request, or they name none), ended them. A finish writes at most one field per slot.
  local finished = late16 and redis.call('HMGET', ended_key, unpack(slots)) or {}
  local buffered, ended = {}, {}
  for i = 1, n do
    local value, finish = holders[i], finished[i]
    if finish then
      rests = rests or split_rests(args[9])
    end
    if finish and ended_by(finish, rests[i], now) then
      ended[#ended + 1] = i
    else
      local delivered = value and value > next16 and not (late16 and value >= late16)
      if delivered and with_rids then
        local rest = rests[i]
        delivered = sub(rest, -1) == ',' or sub(rest, find(rest, ',', 1, true) + 1) == sub(value, 18)
      end
      if not delivered then
        buffered[#buffered + 1] = i
      end
    end
  end

  local superseded = 0
  if #buffered > 0 then
    rests = rests or split_rests(args[9])
    local ttl = tonumber(args[3])
    local deadline = fmt(now + ttl)
    local suffix = ',' .. fmt(now) .. ',' .. deadline -- after "tokens,request_id": recorded at, deadline
    local fields, groups, zadd = {}, {}, {'LT'}
    for k, i in ipairs(buffered) do
      fields[2 * k - 1] = slots[i] .. ':' .. layer
      fields[2 * k] = rests[i] .. suffix
      local group = math.floor(tonumber(slots[i]) / EXPIRY_GROUP)
      if not groups[group] then
        groups[group] = true
        zadd[#zadd + 1] = deadline
        zadd[#zadd + 1] = fmt(group)
      end
    end
    local created = redis.call('HSET', pending_key, unpack(fields))
    superseded = #buffered - created
    note_layer(pending_key, layer)
    -- LT: a group keeps the earlier of its score and this deadline.
    redis.call('ZADD', expiry_key, unpack(zadd))
    keep_alive(pending_key, expiry_key, ttl, tonumber(args[4]))
  end

  -- "recorded" is delivered + buffered, added up when the counters are read.
  count(stats_key, 'delivered', n - #buffered - #ended)
  count(stats_key, 'buffered', #buffered + #ended)
  count(stats_key, 'superseded', superseded)
  count(stats_key, 'finish_dropped', #ended)
  -- The reply's flags (an entry a later finish ended reads B: buffered, then dropped). A batch
  -- all delivered or all buffered, the common ones, is one string.rep; a mixed one is D, then
  -- B where buffered.
  local flags
  local not_delivered = #buffered + #ended
  if not_delivered == 0 or not_delivered == n then
    flags = string.rep(not_delivered == 0 and 'D' or 'B', n)
  else
    local each = {}
    for i = 1, n do
      each[i] = 'D'
    end
    for _, list in ipairs({buffered, ended}) do
      for _, i in ipairs(list) do
        each[i] = 'B'
      end
    end
    flags = table.concat(each)
  end
  return remember_reply(reply_key, 'ok|' .. fmt(now) .. '|' .. flags, args[5])
end

redis.register_function('rls_v2_record_' .. DIGEST, record)
