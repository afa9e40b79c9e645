"""Bad input raises a ValueError subclass that names the field and value, and writes nothing."""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import pytest

from redis_layer_signals import (
    CacheTask,
    InvalidConfig,
    InvalidSignal,
    InvalidTask,
    SignalBuffer,
)
from redis_layer_signals.config import BufferConfig
from redis_layer_signals.protocol.keys import KeySpace


class Layer(enum.IntEnum):
    FIRST = 2


class Named(int):
    """An int whose text is not its digits, on every Python (as an IntEnum's is on 3.10)."""

    def __str__(self) -> str:
        return "two"


HOSTILE = ["", "a{b", "a}b", "{ns}", "a/b", "a*", "a:b", "a b", "a\nb", "a,b", "a;b", "a|b", "é", "x" * 129]


def good_task(**changes: Any) -> CacheTask:
    fields: dict[str, Any] = dict(
        instance="p0", rank=0, slot=5, request_id="req-1", need_prefill_tokens=4096, num_layers=61
    )
    fields.update(changes)
    return CacheTask(**fields)


BAD_CALLS: list[tuple[str, Callable[[SignalBuffer], object], type[Exception], str]] = [
    ("instance", lambda b: b.record("p{0}", 0, 0, [(1, 1)]), InvalidSignal, "instance"),
    ("rank negative", lambda b: b.record("p0", -1, 0, [(1, 1)]), InvalidSignal, "rank"),
    ("rank too big", lambda b: b.record("p0", 65536, 0, [(1, 1)]), InvalidSignal, "rank"),
    ("rank bool", lambda b: b.record("p0", True, 0, [(1, 1)]), InvalidSignal, "rank"),
    ("layer str", lambda b: b.record("p0", 0, "0", [(1, 1)]), InvalidSignal, "layer"),
    ("layer 2**53", lambda b: b.record("p0", 0, 2**53, [(1, 1)]), InvalidSignal, "layer"),
    ("layer at max_layers", lambda b: b.record("p0", 0, 1024, [(1, 1)]), InvalidSignal, "layer"),
    ("entries not list", lambda b: b.record("p0", 0, 0, "5,10"), InvalidSignal, "entries"),
    ("entry shape", lambda b: b.record("p0", 0, 0, [(1,)]), InvalidSignal, "entries[0]"),
    ("slot out of range", lambda b: b.record("p0", 0, 0, [(1, 1), (512, 1)]), InvalidSignal, "entries[1].slot"),
    ("slot float", lambda b: b.record("p0", 0, 0, [(1.0, 1)]), InvalidSignal, "entries[0].slot"),
    ("tokens negative", lambda b: b.record("p0", 0, 0, [(1, -1)]), InvalidSignal, "entries[0].tokens"),
    ("tokens 2**53", lambda b: b.record("p0", 0, 0, [(1, 2**53)]), InvalidSignal, "entries[0].tokens"),
    ("entry request id", lambda b: b.record("p0", 0, 0, [(1, 1, "r}")]), InvalidSignal, "entries[0].request_id"),
    ("batch over 512", lambda b: b.record("p0", 0, 0, [(1, 1)] * 513), InvalidSignal, "entries"),
    ("task type", lambda b: b.register({"slot": 5}), InvalidTask, "task"),  # type: ignore[arg-type]
    ("task slot", lambda b: b.register(good_task(slot=512)), InvalidTask, "slot"),
    ("task request id", lambda b: b.register(good_task(request_id="a b")), InvalidTask, "request_id"),
    ("need negative", lambda b: b.register(good_task(need_prefill_tokens=-1)), InvalidTask, "need_prefill_tokens"),
    ("num_layers zero", lambda b: b.register(good_task(num_layers=0)), InvalidTask, "num_layers"),
    ("num_layers over max", lambda b: b.register(good_task(num_layers=1025)), InvalidTask, "num_layers"),
    ("decode cached", lambda b: b.register(good_task(decode_cached_tokens=-5)), InvalidTask, "decode_cached_tokens"),
    ("meta value", lambda b: b.register(good_task(meta={"k": 1})), InvalidTask, "meta['k']"),
    ("task instance", lambda b: b.register(good_task(instance="a/b")), InvalidTask, "instance"),
    ("replace not bool", lambda b: b.register(good_task(), replace="yes"), InvalidTask, "replace"),  # type: ignore[arg-type]
    ("finish slot", lambda b: b.finish("p0", 0, -1, "req-1"), InvalidTask, "slot"),
    ("finish request", lambda b: b.finish("p0", 0, 1, "*"), InvalidTask, "request_id"),
    ("pending slot", lambda b: b.pending("p0", 0, 9999), InvalidTask, "slot"),
    ("task read instance", lambda b: b.task("p{x}", 0, 1), InvalidTask, "instance"),
]


def keys_now(buf: SignalBuffer) -> set[bytes]:
    """Every key on the server. The real backend is shared with other tests whose reply keys
    expire meanwhile, so a count could drop; a refused call must add no key."""
    return set(buf.client.scan_iter(count=1000))


@pytest.mark.parametrize(("case", "call", "error", "field"), BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_input_raises_naming_field_and_writes_nothing(
    buf: SignalBuffer, case: str, call: Callable[[SignalBuffer], object], error: type[Exception], field: str
) -> None:
    buf.record("p0", 0, 0, [(3, 10)])  # some state, so DBSIZE is not trivially zero
    before = keys_now(buf)
    sent = []
    original = buf._run_script
    buf._run_script = lambda c: sent.append(c) or original(c)  # type: ignore[method-assign]
    with pytest.raises(error) as err:
        call(buf)
    assert isinstance(err.value, ValueError)
    assert err.value.field == field  # type: ignore[attr-defined]
    assert field in str(err.value)
    assert sent == [] and keys_now(buf) <= before


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_identifiers_cannot_reach_a_key(buf: SignalBuffer, name: str) -> None:
    before = keys_now(buf)
    for call in (
        lambda: buf.record(name, 0, 0, [(1, 1)]),
        lambda: buf.record("p0", 0, 0, [(1, 1, name)]),
        lambda: buf.register(good_task(request_id=name)),
        lambda: buf.finish(name, 0, 1, "r"),
    ):
        with pytest.raises(ValueError, match=r"must match"):
            call()
    assert keys_now(buf) <= before


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_namespace_is_refused(name: str) -> None:
    with pytest.raises(InvalidConfig) as err:
        SignalBuffer.from_url("memory://", namespace=name, env={})
    assert err.value.field == "namespace"


def test_max_slots_bounds_slot_numbers(url: str, namespace: str) -> None:
    small = SignalBuffer.from_url(url, namespace=namespace, max_slots=8, env={})
    assert small.record("p0", 0, 0, [(7, 1)]).buffered
    with pytest.raises(InvalidSignal, match=r"entries\[0\]\.slot=8"):
        small.record("p0", 0, 0, [(8, 1)])
    small.close()


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("pending_ttl_s", 0),
        ("task_ttl_s", -1),
        ("retry_s", "3"),
        ("max_slots", 0),
        ("max_slots", 70000),
        ("url", "localhost"),
    ],
)
def test_bad_options_raise_invalid_config(option: str, value: object) -> None:
    with pytest.raises(InvalidConfig) as err:
        BufferConfig.resolve({}, **{option: value})
    assert err.value.field == option


def test_options_fall_back_to_environment_then_defaults() -> None:
    env = {"RLS_NAMESPACE": "prod", "RLS_PENDING_TTL_S": "2.5", "RLS_MAX_SLOTS": "64", "RLS_REDIS_URL": "memory://x"}
    config = BufferConfig.resolve(env, namespace=None, task_ttl_s=None)
    assert (config.namespace, config.pending_ttl_s, config.max_slots, config.url) == ("prod", 2.5, 64, "memory://x")
    assert config.task_ttl_s == 900 and config.retry_s == 3
    assert BufferConfig.resolve(env, namespace="explicit").namespace == "explicit"


def test_unparsable_environment_names_the_variable() -> None:
    with pytest.raises(InvalidConfig) as err:
        BufferConfig.resolve({"RLS_TASK_TTL_S": "soon"})
    assert err.value.field == "RLS_TASK_TTL_S" and err.value.value == "soon"


def test_from_url_reads_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLS_REDIS_URL", "memory://env-test")
    monkeypatch.setenv("RLS_NAMESPACE", "from-env")
    buf = SignalBuffer.from_url()
    assert buf.config.namespace == "from-env" and buf.config.url == "memory://env-test"
    buf.record("p0", 0, 0, [(1, 1)])
    assert any(b"{from-env/p0/0}" in key for key in buf.client.keys("*"))


NAMED_CALLS: list[tuple[str, Callable[[SignalBuffer], object], type[Exception], str]] = [
    ("rank", lambda b: b.record("p0", Named(2), 0, [(1, 1)]), InvalidSignal, "rank"),
    ("layer", lambda b: b.record("p0", 0, Named(2), [(1, 1)]), InvalidSignal, "layer"),
    ("slot", lambda b: b.record("p0", 0, 0, [(Named(2), 1)]), InvalidSignal, "entries[0].slot"),
    ("tokens", lambda b: b.record("p0", 0, 0, [(1, Named(2))]), InvalidSignal, "entries[0].tokens"),
    ("task slot", lambda b: b.register(good_task(slot=Named(2))), InvalidTask, "slot"),
    ("task tokens", lambda b: b.register(good_task(need_prefill_tokens=Named(2))), InvalidTask, "need_prefill_tokens"),
    ("finish slot", lambda b: b.finish("p0", 0, Named(2), "req-1"), InvalidTask, "slot"),
]


@pytest.mark.parametrize(("case", "call", "error", "field"), NAMED_CALLS, ids=[c[0] for c in NAMED_CALLS])
def test_int_subclass_whose_text_is_not_its_digits_is_refused(
    buf: SignalBuffer, case: str, call: Callable[[SignalBuffer], object], error: type[Exception], field: str
) -> None:
    before = keys_now(buf)
    with pytest.raises(error) as err:
        call(buf)
    assert err.value.field == field  # type: ignore[attr-defined]
    assert "'two'" in str(err.value)
    assert keys_now(buf) <= before


def test_intenum_layer_never_writes_field_named_after_the_enum(buf: SignalBuffer) -> None:
    """Python 3.10 prints an IntEnum as ``Layer.FIRST``: it reached Lua, which wrote the pending
    field ``2:Layer.FIRST`` and then raised. It is refused there, and written as its digits
    where its text is its digits (3.11+)."""
    before = keys_now(buf)
    if str(Layer.FIRST) != "2":
        with pytest.raises(InvalidSignal) as err:
            buf.record("p0", Layer.FIRST, Layer.FIRST, [(Layer.FIRST, 100)])
        assert err.value.field == "rank"
        assert keys_now(buf) <= before
        return
    result = buf.record("p0", Layer.FIRST, Layer.FIRST, [(Layer.FIRST, 100)])
    assert [(s.slot, s.layer, s.tokens) for s in result.buffered] == [(2, 2, 100)]
    pending = buf.client.hgetall(KeySpace(buf.config.namespace).rank("p0", 2).pending)
    assert pending and all(b"Layer" not in field and b"Layer" not in value for field, value in pending.items())
