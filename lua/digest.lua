-- digest.lua: FCALL rls_v2_digest, which code this server's rls_v2 library was built from.
--
-- keys[1] any key of the rank the caller is about to call (not read: it only routes the
--         call to the rank's node on a Cluster)
-- args[1] none
--
-- Reply: the library's digest, 64 hex digits (see DIGEST in _lib.lua).
--
-- Guarantees: writes nothing. Its name carries no digest, so every build of this library
-- answers it: a client that finds its own functions missing asks it, and tells a server
-- without the library (load it) from one whose rls_v2 is other code (refuse it, naming both
-- digests). The digest is what the library says of itself: code edited by hand can claim any.

local function digest(keys, args)
  return DIGEST
end

redis.register_function{function_name = 'rls_v2_digest', callback = digest, flags = {'no-writes'}}
