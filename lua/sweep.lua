-- sweep.lua: count and remove the pending signals of one instance and rank whose TTL ran out.
--
-- KEYS[1] pending  hash  slot -> packed pending records (see _lib.lua)
-- KEYS[2] expiry   zset  slot group -> earliest pending deadline of the group (see _lib.lua)
-- KEYS[3] stats    hash  counters (no TTL)
-- ARGV[1] now_ms (empty: server TIME)   ARGV[2] limit (slots per run)
--
-- Reply: integer, the number of signals expired by this run.
--
-- Guarantees: each expired signal is counted once under "expired" and removed in the same
-- script; at most ARGV[2] slots' worth of groups with expired signals are visited (see sweep in
-- _lib.lua), so a caller loops while the reply is not zero. record, register and finish
-- run the same sweep on their own rank; this script lets a reader (stats, an
-- operator) count expiries on a rank that has gone quiet.

return sweep(KEYS[1], KEYS[2], KEYS[3], now_ms(ARGV[1]), ARGV[2])
