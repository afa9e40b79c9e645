-- permissions.lua: FCALL rls_v2_permissions_<digest>, whether the calling user may run every command the
-- other functions of this library may run, on one rank's keys. It writes nothing.
--
-- keys[1] live     hash    (see _lib.lua)
-- keys[2] pending  hash
-- keys[3] expiry   zset
-- keys[4] stats    hash
-- keys[5] reply    string  a reply key of the rank (any token: ACL patterns match names)
-- keys[6] ended    hash
-- args[1] none; the function takes no arguments
--
-- Reply: "" when every command is allowed, else "<command> <key>": the first one refused
-- ("<command>" alone for TIME, which takes no key).
--
-- Guarantees: a function that meets a refused command stops there, and what it wrote before
-- stays written. The client calls this once per rank and connection to a node, before the
-- first function call that could write, so a missing permission is found before anything is
-- written (redis.acl_check_cmd, Redis 7.0+ and Valkey; a server without it, such as the
-- in-memory fake, reports everything allowed). Each check names the command with the key it
-- is run on and arguments of the right number, as the functions call it.

local function permissions(keys, args)
  if not redis.acl_check_cmd then
    return ''
  end
  local live, pending, expiry, stats, reply, ended = keys[1], keys[2], keys[3], keys[4], keys[5], keys[6]
  local checks = {
    {'time'},
    {'get', reply},
    {'set', reply, 'v', 'PX', '1'},
    {'hincrby', stats, 'f', '1'},
    {'zrangebyscore', expiry, '-inf', '0', 'LIMIT', '0', '1'},
    {'zadd', expiry, '0', 'g'},
    {'zrem', expiry, 'g'},
    {'pexpire', expiry, '1'},
    {'del', expiry},
  }
  for _, hash in ipairs({live, pending, ended}) do
    checks[#checks + 1] = {'hget', hash, 'f'}
    checks[#checks + 1] = {'hmget', hash, 'f'}
    checks[#checks + 1] = {'hset', hash, 'f', 'v'}
    checks[#checks + 1] = {'hdel', hash, 'f'}
    checks[#checks + 1] = {'hlen', hash}
    checks[#checks + 1] = {'pttl', hash}
    checks[#checks + 1] = {'pexpire', hash, '1'}
    checks[#checks + 1] = {'del', hash}
  end
  for _, check in ipairs(checks) do
    if not redis.acl_check_cmd(unpack(check)) then
      return table.concat(check, ' ', 1, math.min(#check, 2))
    end
  end
  return ''
end

redis.register_function{function_name = 'rls_v2_permissions_' .. DIGEST, callback = permissions, flags = {'no-writes'}}
