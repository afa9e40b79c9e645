-- claim.lua: FCALL rls_v2_claim_<digest>, one FastDeploy bridge process claims, renews or gives
-- up the identity (instance, rank) whose state it writes: one identity, one owner.
--
-- keys[1] identity string  "<token>|<host>|<pid>|<pid namespace>|<claimed at ms>": the process
--                          that owns the rank, under a lease (the key's TTL)
-- keys[2] stats    hash    counters (no TTL)
-- args[1] action: "claim" (claim, or renew a claim of the same token) or "release"
-- args[2] token: names the claiming process (its writer's token)
-- args[3] owner: "<host>|<pid>|<pid namespace>", what the key says of the process
-- args[4] lease in ms (claim only)
-- args[5] takeover: the token of a holder the caller proved gone ('' none): replaced at once
-- args[6] "1" to count a refusal under "identity_refused" (the first of an episode), else "0"
--
-- Reply: for a claim, "claimed|" (the identity was free), "renewed|" (the caller held it),
-- "took|<the holder's value>" (replaced the holder named by args[5]), or
-- "taken|<the holder's value>": another live process holds it, nothing was written but the
-- counter. For a release: "released|" or "kept|<the holder's value>" ('' when none held it).
--
-- Guarantees: the token is checked before any write (fencing), so a process never renews,
-- replaces or deletes another's claim, save the one holder the caller names as gone. The
-- identity key always carries the lease as its TTL: a process that died frees its identity
-- once the lease runs out. A claim resent after a lost reply finds its own token: "renewed".

local function claim(keys, args)
  local identity_key, stats_key = keys[1], keys[2]
  local action, token, owner, takeover = args[1], args[2], args[3], args[5]
  local held = redis.call('GET', identity_key)
  local holder = held and string.match(held, '^([^|]*)|') or nil

  if action == 'release' then
    if holder == token then
      redis.call('DEL', identity_key)
      return 'released|'
    end
    return 'kept|' .. (held or '')
  end

  local value = token .. '|' .. owner .. '|' .. fmt(now_ms(''))
  if holder == token then
    -- Renewed: the first claim's time is kept (the value's last field).
    redis.call('SET', identity_key, token .. '|' .. owner .. '|' .. string.match(held, '([^|]*)$'), 'PX', args[4])
    return 'renewed|'
  end
  if not held then
    redis.call('SET', identity_key, value, 'PX', args[4])
    return 'claimed|'
  end
  if takeover ~= '' and holder == takeover then
    redis.call('SET', identity_key, value, 'PX', args[4])
    return 'took|' .. held
  end
  if args[6] == '1' then
    redis.call('HINCRBY', stats_key, 'identity_refused', 1)
  end
  return 'taken|' .. held
end

redis.register_function('rls_v2_claim_' .. DIGEST, claim)
