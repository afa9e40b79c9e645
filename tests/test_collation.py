"""The scripts under a server collation that is not C.

redis-server calls ``setlocale(LC_COLLATE, "")``, and Lua compares strings with ``strcoll``. Under
a locale such as en_US.UTF-8, punctuation weighs nothing at the first level, so
``"<stamp>|r5" > "<stamp>~"``, false in C, is true there. Every comparison in the scripts must
give the same answer under any collation: stamps and decimals are compared digits against
digits, and a live entry ``"<deadline>|<request id>"`` is compared with a stamp of digits only.

The locale is compiled into a temp dir with ``localedef`` (glibc's, from libc-bin) and handed to
the server through ``LOCPATH``, so the test needs no locale installed system-wide.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator

import pytest
import redis

from redis_layer_signals import CacheTask, SignalBuffer, SlotOccupied
from tests.servers import RedisServer

LOCALE = "en_US.UTF-8"
START_MS = 1_764_000_000_000


@pytest.fixture(scope="module")
def collated_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    localedef = shutil.which("localedef")
    assert localedef is not None, "localedef (Debian's libc-bin) is needed to build the test locale"
    locales = tmp_path_factory.mktemp("locales")
    built = subprocess.run(
        [localedef, "-i", "en_US", "-f", "UTF-8", str(locales / LOCALE)], capture_output=True, text=True
    )
    assert (locales / LOCALE).is_dir(), f"localedef could not build {LOCALE}: {built.stderr}"
    server = RedisServer(env={"LOCPATH": str(locales), "LC_ALL": LOCALE}).start()
    try:
        yield server
    finally:
        server.cleanup()


def test_the_server_really_collates_with_the_locale(collated_server: RedisServer) -> None:
    """The premise: without it, the tests below would prove nothing."""
    client: redis.Redis = collated_server.client()
    try:
        compare = "return {(ARGV[1] > ARGV[2]) and 1 or 0, (ARGV[3] > ARGV[4]) and 1 or 0}"
        stamp = "0001764000001000"
        assert client.eval(compare, 0, stamp + "|r5", stamp + "~", "10", "9") == [1, 0]
    finally:
        client.close()


@pytest.mark.parametrize(("elapsed_ms", "delivered"), [(999, True), (1_000, False), (1_001, False)])
def test_a_lease_ends_at_its_deadline_for_record_as_for_register(
    collated_server: RedisServer, elapsed_ms: int, delivered: bool
) -> None:
    """A task registered with a 1 s lease holds its slot until, not at, its deadline: record
    delivers to it only before, and another request may take the slot from then on."""
    now = [START_MS]
    buf = SignalBuffer.from_url(
        collated_server.url, namespace=f"collate{elapsed_ms}", task_ttl_s=1, clock=lambda: now[0], env={}
    )
    try:
        buf.register(CacheTask("p0", 0, 5, "req-1", need_prefill_tokens=4096, num_layers=61))
        now[0] = START_MS + elapsed_ms
        res = buf.record("p0", 0, 0, [(5, 100)])
        assert (len(res.delivered), len(res.buffered)) == ((1, 0) if delivered else (0, 1))
        other = CacheTask("p0", 0, 5, "req-2", need_prefill_tokens=4096, num_layers=61)
        if delivered:
            with pytest.raises(SlotOccupied):
                buf.register(other)
        else:
            assert [s.tokens for s in buf.register(other).recovered] == [100]
    finally:
        buf.close()


def test_drop_reasons_compare_numbers_not_text(collated_server: RedisServer) -> None:
    """Layers and tokens of different lengths, on the collated server."""
    buf = SignalBuffer.from_url(collated_server.url, namespace="collate-reasons", clock=lambda: START_MS, env={})
    try:
        for layer in (10, 9, 100, 2):
            buf.record("p0", 0, layer, [(5, 99 if layer != 100 else 1000)])
        rec = buf.register(CacheTask("p0", 0, 5, "req-1", need_prefill_tokens=100, num_layers=100))
        assert [s.layer for s in rec.recovered] == [2, 9, 10]
        assert [(s.layer, r.value) for s, r in rec.dropped] == [(100, "layer_out_of_range")]
    finally:
        buf.close()
