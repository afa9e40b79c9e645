-- group.lua: FCALL rls_v2_group_<digest>, the tensor-parallel ranks of one instance agree on the
-- layer-0 entries none of them could release: each entry is released by all or given up by all.
--
-- Every rank of a group sees the same layer-0 entries in the same order and numbers them alike
-- (0, 1, 2, ...). A rank releases them in that order, each once its task is registered on the
-- rank. One whose task has not registered after a while is voted on here: the rank never releases
-- it on its own any more and asks the group instead.
--
-- keys[1] members  hash    member -> "<token>|<handled>|<generation>": the highest sequence
--                          number that member has handled (released, dropped or given up), -1
--                          for none, and the claim (token, generation) of the rank it wrote under
-- keys[2] votes    hash    sequence number -> ",<member>,<member>,": the members that voted to
--                          give it up
-- keys[3] outcomes hash    sequence number -> "released" or "abandoned": final once written
-- args[1] now_ms (empty: server TIME)   args[2] nranks: members in the group
-- args[3] member (0 .. nranks - 1)      args[4] token: the claim's token of the member's rank
-- args[5] handled: the member's highest handled sequence number (-1 for none)
-- args[6] key TTL in ms                 args[7] the generation of the rank's claim (claim.lua)
-- args[8...] sequence numbers the member votes to give up (and asks the outcome of)
--
-- Reply: "fenced|<now ms>|<the member's record>" when a later claim of the rank wrote here
-- (owner_fence in _lib.lua): the caller lost its rank, and nothing was written. Else
-- "ok|<now ms>|<reset>;<outcome>,<outcome>,...": reset is 1 when the member came with a
-- token the group did not know (see below), else 0; then one outcome per voted sequence
-- number, in order: "released", "abandoned" or "open" (ask again later).
--
-- Guarantees: a sequence number is "released" when some member handled it without voting on it:
-- that member released it (or dropped it by its task's verdict), so every voter releases it once
-- its own adder registers the task, as all adders do in lockstep. It is "abandoned" when all
-- nranks members voted: none of them will ever release it. A voter never releases on its own, so
-- both cannot hold; the first that holds is written to outcomes and answered from then on. A
-- member reports "handled" only past an entry it voted on once its vote is in, so the mark never
-- tells of a release that did not happen. Votes and repeats are idempotent (a resend, a poll).
-- A member writes only under its rank's claim: one whose claim is older than the one the member
-- last wrote under is refused (owner_fence), so a process that lost its rank to another
-- changes nothing of the group. Sequence numbers restart at 0 with the processes: a member
-- whose stored token differs from the one it sends (a newer claim) started again, and every key
-- of the group is reset (all ranks of an instance start together, long before any of them gives
-- up on an entry). Every key carries the TTL of args[6], refreshed by each call. Work is bounded
-- by nranks and the sequence numbers sent.

local function group(keys, args)
  local members_key, votes_key, outcomes_key = keys[1], keys[2], keys[3]
  local now = now_ms(args[1])
  local nranks, member, token, handled = tonumber(args[2]), args[3], args[4], args[5]

  local reset = 0
  local stored = redis.call('HGET', members_key, member)
  if not owner_fence(stored, token, args[7]) then
    return 'fenced|' .. fmt(now) .. '|' .. stored
  end
  if stored and string.match(stored, '^([^|]*)|') ~= token then
    redis.call('DEL', members_key, votes_key, outcomes_key)
    reset = 1
  end
  redis.call('HSET', members_key, member, token .. '|' .. handled .. '|' .. args[7])

  -- Each member's highest handled sequence number, -1 for a member not heard from yet.
  local names = {}
  for m = 0, nranks - 1 do
    names[#names + 1] = fmt(m)
  end
  local marks = redis.call('HMGET', members_key, unpack(names))
  local handled_by = {}
  for i, name in ipairs(names) do
    handled_by[name] = marks[i] and tonumber(string.match(marks[i], '^[^|]*|(-?%d+)')) or -1
  end

  local outcomes = {}
  for i = 8, #args do
    local seq = args[i]
    local outcome = redis.call('HGET', outcomes_key, seq)
    if not outcome then
      local voters = redis.call('HGET', votes_key, seq) or ','
      if not string.find(voters, ',' .. member .. ',', 1, true) then
        voters = voters .. member .. ','
        redis.call('HSET', votes_key, seq, voters)
      end
      local voted = 0
      outcome = 'open'
      for _, name in ipairs(names) do
        local voter = string.find(voters, ',' .. name .. ',', 1, true) ~= nil
        if voter then
          voted = voted + 1
        elseif handled_by[name] >= tonumber(seq) then
          outcome = 'released'
        end
      end
      if outcome == 'open' and voted >= nranks then
        outcome = 'abandoned'
      end
      if outcome ~= 'open' then
        redis.call('HSET', outcomes_key, seq, outcome)
      end
    end
    outcomes[#outcomes + 1] = outcome
  end

  redis.call('PEXPIRE', members_key, args[6])
  redis.call('PEXPIRE', votes_key, args[6])
  redis.call('PEXPIRE', outcomes_key, args[6])
  return 'ok|' .. fmt(now) .. '|' .. reset .. ';' .. table.concat(outcomes, ',')
end

redis.register_function('rls_v2_group_' .. DIGEST, group)
