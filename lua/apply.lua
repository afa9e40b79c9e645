-- apply.lua: FCALL rls_v2_apply_<digest>, write what the one process that owns an instance and rank
-- decided (the FastDeploy bridge with registers_tasks): each listed slot's state as it is in
-- that process now, and the counters its decisions advanced.
--
-- keys[1] live     hash    slot -> "<lease deadline ms, 16 digits>|<request id>";
--                          "<slot>:doc" -> task document; "<slot>:recovery" -> its first
--                          payload; '~'
-- keys[2] pending  hash    "<slot>:<layer>" -> pending signal; "layers" (see _lib.lua)
-- keys[3] expiry   zset    slot group -> at or before its earliest pending deadline
-- keys[4] stats    hash    counters (no TTL)
-- keys[5] writer   string  "<batch>|<reply>": the last batch this writer's process applied
--                          and its reply (one key per writing process, not one per call)
-- keys[6] identity string  the claim of the process that owns the rank (claim.lua)
-- keys[7] clash    string  the last process the fence refused (owner_fence in _lib.lua)
-- args[1] now_ms (empty: server TIME)   args[2] layer of the pending signals
-- args[3] pending_ttl_ms                args[4] pending key TTL in ms (pending_ttl + grace)
-- args[5] task_ttl_ms                   args[6] live key TTL in ms (task_ttl + grace)
-- args[7] writer key TTL in ms          args[8] batch: the writer's sequence number of this call
-- args[9] counters to add, "<name>=<n>;" each: decisions on signals and tasks Redis never saw
-- args[10] the writer's claim: its token    args[11] its claim's generation
-- args[12] "<host>|<pid>|<pid namespace>" of the writer, noted when the fence refuses it
-- args[13] clash key TTL in ms
-- args[14...] eight per slot:
--   slot; prior: the request id the process last wrote as the slot's holder ('' none, '?'
--   unknown); lease: the live entry, "<deadline ms16>|<request id>" ('' the slot has no task);
--   document; recovery payload; pending: the slot's signal of args[2] as stored,
--   "tokens,request_id,recorded_at,deadline" ('' none); fate: a counter counted once if the
--   field still holds the value in the next argument ('' none); that value.
--
-- Reply: "fenced|<now ms>|<the identity's claim>" when another process claimed the rank after
-- the writer did (owner_fence): nothing of the batch was written, the refusal is counted
-- ("ownership_fenced") and noted for the owner. Else "ok|<now ms>|<overridden>,<tasks>,<pending>":
-- overridden, the slots whose holder in Redis was not the one the process last wrote there (a
-- restart, a failover, a holder left by a dead process), each also counted under "overridden";
-- then the tasks and the pending signals the rank holds after this call, which the process
-- compares with what it believes Redis holds (a restart that lost slots this call did not list
-- shows there).
--
-- Guarantees: the process is the judge and Redis its copy, so each listed slot ends exactly as
-- the process holds it: its task (or none) and its pending signal (or none), with the times the
-- process decided at. A fate is counted only while Redis still holds the signal it ends: one
-- that a reader's sweep expired meanwhile is counted once, as expired. No sweep runs here (the
-- process decides expiries and sends them as fates). The writer sends its batches one at a
-- time, numbered, and resends one until it has the reply: a resend of the batch the writer key
-- names returns the first reply and writes nothing new, however long the outage that delayed
-- it (a per-call reply key would expire, and the resend would add the counters again): a batch
-- applied while the writer owned the rank stays applied, and the fence judges only new ones. Work
-- is bounded by the slots listed (one HGET of the live hash and at most two of the pending
-- hash each).

local SLOT_ARGS = 8

local function apply(keys, args)
  local live_key, pending_key, expiry_key, stats_key, writer_key = keys[1], keys[2], keys[3], keys[4], keys[5]

  local batch = args[8]
  local last = redis.call('GET', writer_key)
  if last and string.sub(last, 1, #batch + 1) == batch .. '|' then
    redis.call('HINCRBY', stats_key, 'replayed', 1)
    return string.sub(last, #batch + 2)
  end

  local now = now_ms(args[1])
  local held = redis.call('GET', keys[6])
  if not owner_fence(held, args[10], args[11]) then
    note_clash(keys[7], stats_key, 'ownership_fenced', args[10] .. '|' .. args[12], now, 'write', tonumber(args[13]))
    return 'fenced|' .. fmt(now) .. '|' .. held
  end
  local layer = args[2]
  local pending_ttl, task_ttl = tonumber(args[3]), tonumber(args[5])

  for name, n in string.gmatch(args[9], '([^=;]+)=(%d+);') do
    count(stats_key, name, tonumber(n))
  end

  local overridden, live_set, live_deleted, pending_set, pending_deleted = 0, false, false, false, {}
  local zadd = {'LT'}
  for first = 14, #args, SLOT_ARGS do
    local slot, prior, lease, doc, recovery, signal, fate, fated = unpack(args, first, first + SLOT_ARGS - 1)

    local current = redis.call('HGET', live_key, slot)
    local current_id = current and string.sub(current, 18) or ''
    if prior ~= '?' and current_id ~= prior then
      overridden = overridden + 1
    end
    if lease == '' then
      if current then
        redis.call('HDEL', live_key, slot, slot .. ':doc', slot .. ':recovery')
        live_deleted = true
      end
    elseif lease ~= current then
      redis.call('HSET', live_key, slot, lease, slot .. ':doc', doc, slot .. ':recovery', recovery,
        HASHTABLE_FIELD, HASHTABLE_VALUE)
      live_set = true
    end

    local field = slot .. ':' .. layer
    if fate ~= '' and redis.call('HGET', pending_key, field) == fated then
      redis.call('HINCRBY', stats_key, fate, 1)
    end
    if signal == '' then
      pending_deleted[#pending_deleted + 1] = field
    else
      redis.call('HSET', pending_key, field, signal)
      local _, _, _, deadline = parse_signal(signal)
      zadd[#zadd + 1] = deadline
      zadd[#zadd + 1] = fmt(math.floor(tonumber(slot) / EXPIRY_GROUP))
      pending_set = true
    end
  end

  if live_set then
    keep_alive(live_key, nil, task_ttl, tonumber(args[6]))
  elseif live_deleted and redis.call('HLEN', live_key) <= 1 then
    redis.call('DEL', live_key)
  end
  if pending_set then
    note_layer(pending_key, layer)
    redis.call('ZADD', expiry_key, unpack(zadd))
    keep_alive(pending_key, expiry_key, pending_ttl, tonumber(args[4]))
  end
  if #pending_deleted > 0 then
    hdel(pending_key, pending_deleted)
    drop_pending_if_empty(pending_key, expiry_key)
  end
  count(stats_key, 'overridden', overridden)

  -- Each task is three fields of live, each signal one of pending; both hashes also hold '~',
  -- pending "layers" too.
  local tasks = math.max(0, math.floor((redis.call('HLEN', live_key) - 1) / 3))
  local signals = math.max(0, redis.call('HLEN', pending_key) - 2)
  local reply = 'ok|' .. fmt(now) .. '|' .. overridden .. ',' .. tasks .. ',' .. signals
  redis.call('SET', writer_key, batch .. '|' .. reply, 'PX', args[7])
  return reply
end

redis.register_function('rls_v2_apply_' .. DIGEST, apply)
