-- sweep.lua: FCALL rls_v2_sweep_<digest>, count and remove the pending signals of one instance and rank
-- whose TTL ran out.
--
-- keys[1] pending  hash    "<slot>:<layer>" -> pending signal; "layers" (see _lib.lua)
-- keys[2] expiry   zset    slot group -> at or before its earliest pending deadline
-- keys[3] stats    hash    counters (no TTL)
-- args[1] now_ms (empty: server TIME)   args[2] limit (slots per run)
--
-- Reply: integer, the number of signals expired by this run.
--
-- Guarantees: each expired signal is counted once under "expired" and removed in the same
-- function; at most args[2] slots' worth of groups with expired signals are visited (see
-- sweep in _lib.lua), so a caller loops while the reply is not zero. record, register and
-- finish run the same sweep on their own rank first; this lets a reader (stats, an operator)
-- count expiries on a rank that has gone quiet.
--
-- Flag allow-oom: the sweep only frees memory (it adds to existing counters), so it runs on a
-- server at maxmemory (noeviction) and makes room there.

local function sweep_rank(keys, args)
  return sweep(keys[1], keys[2], keys[3], now_ms(args[1]), args[2])
end

redis.register_function{function_name = 'rls_v2_sweep_' .. DIGEST, callback = sweep_rank, flags = {'allow-oom'}}
