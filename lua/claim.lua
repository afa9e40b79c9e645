-- claim.lua: FCALL rls_v2_claim_<digest>, one FastDeploy bridge process claims, renews or gives
-- up the identity (instance, rank) whose state it writes: one identity, one owner.
--
-- keys[1] identity string  "<token>|<host>|<pid>|<pid namespace>|<claimed at ms>|
--                          <lease until ms>|<generation>": the process that owns the rank, its
--                          lease, and its claim's generation
-- keys[2] stats    hash    counters (no TTL)
-- keys[3] clash    string  the last process the fence refused (see owner_fence in _lib.lua)
-- args[1] action: "claim" (claim, or renew a claim of the same token) or "release"
-- args[2] token: names the claiming process (its writer's token)
-- args[3] owner: "<host>|<pid>|<pid namespace>", what the key says of the process
-- args[4] lease in ms (claim only)
-- args[5] takeover: the token of a holder the caller proved gone ('' none): replaced at once
-- args[6] "1" to count and note a refusal (the first of an episode), else "0"
-- args[7] how long, in ms, the identity key and the clash key outlive the lease
--
-- Reply: for a claim, "<outcome>|<generation>|<other>": "claimed" (the identity was free),
-- "renewed" (the caller held it; other: the clash key's note of a process refused since, ''
-- none), "took" (replaced the holder named by args[5]; other: its claim), "lapsed" (replaced a
-- holder whose lease had run out; other: its claim), or "taken" (another live process holds
-- it: nothing was written but the counter and the note; other: its claim). generation is the
-- caller's claim's (0 when taken): every write of the owner carries it with the token. For a
-- release: "released||" or "kept||<the holder's value>" ('' when none held it).
--
-- Guarantees: the token is checked before any write (fencing), so a process never renews,
-- replaces or deletes another's live claim, save the one holder the caller names as gone. A
-- claim's lease is the server's time: a process that died frees its identity once its lease
-- runs out. The key outlives the lease by args[7], so whoever claims next learns whom it
-- replaced ("lapsed") and the generations keep growing (each new claim's is above the last
-- and at least the server's time in ms). A claim resent after a lost reply finds its own
-- token: "renewed".

local function claim(keys, args)
  local identity_key, stats_key, clash_key = keys[1], keys[2], keys[3]
  local action, token, owner, takeover = args[1], args[2], args[3], args[5]
  local lease, kept = tonumber(args[4]), tonumber(args[7])
  local held = redis.call('GET', identity_key)
  local holder, since, lease_until, generation
  if held then
    holder, since, lease_until, generation = string.match(held, '^([^|]*)|.*|(%d+)|(%d+)|(%d+)$')
  end

  if action == 'release' then
    if holder == token then
      redis.call('DEL', identity_key, clash_key)
      return 'released||'
    end
    return 'kept||' .. (held or '')
  end

  local now = now_ms('')
  local function write(claimed_at, gen)
    redis.call('SET', identity_key, token .. '|' .. owner .. '|' .. claimed_at .. '|' .. fmt(now + lease) .. '|' .. gen,
      'PX', lease + kept)
  end

  if holder == token and generation then
    -- Renewed: the first claim's time and generation are kept. A process the fence refused
    -- since is reported once.
    write(since, generation)
    local clash = redis.call('GET', clash_key)
    if clash and string.match(clash, '^([^|]*)|') ~= token then
      redis.call('DEL', clash_key)
      return 'renewed|' .. generation .. '|' .. clash
    end
    return 'renewed|' .. generation .. '|'
  end
  local next_generation = fmt(math.max(now, (tonumber(generation) or 0) + 1))
  if not held then
    write(fmt(now), next_generation)
    return 'claimed|' .. next_generation .. '|'
  end
  if takeover ~= '' and holder == takeover then
    write(fmt(now), next_generation)
    return 'took|' .. next_generation .. '|' .. held
  end
  if (tonumber(lease_until) or 0) <= now then
    write(fmt(now), next_generation)
    return 'lapsed|' .. next_generation .. '|' .. held
  end
  if args[6] == '1' then
    note_clash(clash_key, stats_key, 'identity_refused', token .. '|' .. owner, now, 'claim', lease + kept)
  end
  return 'taken|0|' .. held
end

redis.register_function('rls_v2_claim_' .. DIGEST, claim)
