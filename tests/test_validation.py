"""Bad input raises a ValueError subclass that names the field and value, and writes nothing."""

from __future__ import annotations

import enum
import re
from collections.abc import Callable
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from redis_layer_signals import (
    CacheTask,
    DropReason,
    InvalidConfig,
    InvalidSignal,
    InvalidTask,
    LayerSignal,
    SignalBuffer,
)
from redis_layer_signals.config import BufferConfig
from redis_layer_signals.constants import IDENTIFIER_PATTERN
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
        with pytest.raises(ValueError, match=r"must be a string matching"):
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


# -- one message per bound, checked where the value is made ----------------------------------


@pytest.mark.parametrize("layer", [-1, 1024, 1_000_000, 2**53])
def test_layer_out_of_range_names_the_one_true_range(buf: SignalBuffer, layer: int) -> None:
    """``layer=-1`` was told ``[0, 9007199254740992)`` while ``layer=1000000`` was told
    ``below max_layers=1024``: two bounds for one field. Both now get the range that holds."""
    with pytest.raises(InvalidSignal) as err:
        buf.record("p0", 0, layer, [(1, 1)])
    assert str(err.value) == f"invalid signal field layer={layer}: must be in [0, 1024) (max_layers)"


def test_layer_of_the_wrong_type_is_told_the_type_and_the_range(buf: SignalBuffer) -> None:
    with pytest.raises(InvalidSignal) as err:
        buf.record("p0", 0, "3", [(1, 1)])  # type: ignore[arg-type]
    assert str(err.value) == "invalid signal field layer='3': must be an int in [0, 1024) (max_layers), not str"


def test_num_layers_and_slot_name_the_option_that_bounds_them(buf: SignalBuffer) -> None:
    with pytest.raises(InvalidTask, match=r"num_layers=1025: must be in \[1, 1024\] \(max_layers\)$"):
        buf.register(good_task(num_layers=1025))
    with pytest.raises(InvalidTask, match=r"slot=512: must be in \[0, 512\) \(max_slots\)$"):
        buf.register(good_task(slot=512))
    with pytest.raises(InvalidSignal, match=r"entries\[0\]\.slot=-1: must be in \[0, 512\) \(max_slots\)$"):
        buf.record("p0", 0, 0, [(-1, 1)])


@pytest.mark.parametrize(
    ("call", "error", "field"),
    [
        (lambda b: b.finish("p0", 0, 1, 1), InvalidTask, "request_id"),
        (lambda b: b.record("p0", 0, 0, [(1, 1, 7)]), InvalidSignal, "entries[0].request_id"),
        (lambda b: b.register(good_task(request_id=1)), InvalidTask, "request_id"),
        (lambda b: b.record(5, 0, 0, [(1, 1)]), InvalidSignal, "instance"),
    ],
    ids=["finish", "record entry", "task", "instance"],
)
def test_integer_request_id_is_told_it_must_be_a_string(
    buf: SignalBuffer, call: Callable[[SignalBuffer], object], error: type[Exception], field: str
) -> None:
    with pytest.raises(error) as err:
        call(buf)
    assert err.value.field == field  # type: ignore[attr-defined]
    assert str(err.value).endswith(": must be a string matching [A-Za-z0-9._-]{1,128}, not int")


def test_cache_task_with_string_rank_and_slot_fails_where_it_is_built() -> None:
    """``CacheTask(rank="0", slot="5")`` was built, and refused only at ``register``."""
    with pytest.raises(InvalidTask) as err:
        CacheTask(instance="p0", rank="0", slot="5", request_id="r", need_prefill_tokens=1, num_layers=1)  # type: ignore[arg-type]
    assert (err.value.field, err.value.value) == ("rank", "0")
    assert str(err.value) == "invalid task field rank='0': must be an int in [0, 65536), not str"
    with pytest.raises(InvalidTask, match=r"slot='5': must be an int in \[0, 65535\)"):
        good_task(slot="5")


def test_layer_signal_with_a_bad_field_fails_where_it_is_built() -> None:
    with pytest.raises(InvalidSignal) as err:
        LayerSignal("p0", 0, 5, -1, 10, None, 0)
    assert str(err.value) == "invalid signal field layer=-1: must be in [0, 2**53)"
    with pytest.raises(InvalidSignal, match=r"request_id=b'r': must be a string matching"):
        LayerSignal("p0", 0, 5, 0, 10, b"r", 0)  # type: ignore[arg-type]


def test_zero_token_signal_is_kept_and_dropped_as_non_positive_at_register(buf: SignalBuffer) -> None:
    """tokens=0 is accepted on purpose (FastDeploy keeps it and drops it at registration; a
    GPU batch is never refused for one entry): it ends in exactly one place, a counted drop."""
    assert [s.tokens for s in buf.record("p0", 0, 0, [(5, 0)]).buffered] == [0]
    result = buf.register(good_task())
    assert result.recovered == [] and [(s.tokens, why) for s, why in result.dropped] == [(0, DropReason.NON_POSITIVE)]
    assert buf.stats()["dropped_non_positive"] == 1


# -- every bad value of every field: the right error, the field and value named ---------------

_NOT_INT = st.one_of(st.none(), st.booleans(), st.floats(allow_nan=False), st.text(max_size=3), st.binary(max_size=3))
_NOT_IDENTIFIER = st.one_of(
    st.none(),
    st.integers(),
    st.binary(max_size=3),
    st.text(max_size=130).filter(lambda text: re.fullmatch(IDENTIFIER_PATTERN, text) is None),
)


def _ints_outside(low: int, high: int) -> st.SearchStrategy[Any]:
    return st.one_of(_NOT_INT, st.integers(max_value=low - 1), st.integers(min_value=high))


TASK_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "instance": _NOT_IDENTIFIER,
    "rank": _ints_outside(0, 65536),
    "slot": _ints_outside(0, 65535),
    "request_id": _NOT_IDENTIFIER,
    "need_prefill_tokens": _ints_outside(0, 2**53),
    "num_layers": _ints_outside(1, 2**53),
    "decode_cached_tokens": _ints_outside(0, 2**53),
}
SIGNAL_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "instance": _NOT_IDENTIFIER,
    "rank": _ints_outside(0, 65536),
    "slot": _ints_outside(0, 65535),
    "layer": _ints_outside(0, 2**53),
    "tokens": _ints_outside(0, 2**53),
    "request_id": _NOT_IDENTIFIER.filter(lambda value: value is not None),
    "recorded_at_ms": _ints_outside(0, 2**53),
}


@given(data=st.data(), field=st.sampled_from(sorted(TASK_FIELDS)))
def test_any_bad_cache_task_field_raises_invalid_task_naming_it(data: st.DataObject, field: str) -> None:
    value = data.draw(TASK_FIELDS[field], label=field)
    with pytest.raises(InvalidTask) as err:
        good_task(**{field: value})
    assert (err.value.field, err.value.value) == (field, value)
    assert f"field {field}={value!r}: must be " in str(err.value)


@given(data=st.data(), field=st.sampled_from(sorted(SIGNAL_FIELDS)))
def test_any_bad_layer_signal_field_raises_invalid_signal_naming_it(data: st.DataObject, field: str) -> None:
    fields: dict[str, Any] = dict(instance="p0", rank=0, slot=5, layer=0, tokens=10, request_id=None, recorded_at_ms=0)
    fields[field] = value = data.draw(SIGNAL_FIELDS[field], label=field)
    with pytest.raises(InvalidSignal) as err:
        LayerSignal(**fields)
    assert (err.value.field, err.value.value) == (field, value)
    assert f"field {field}={value!r}: must be " in str(err.value)


RECORD_ARGS: dict[str, st.SearchStrategy[Any]] = {
    "instance": _NOT_IDENTIFIER,
    "rank": _ints_outside(0, 65536),
    "layer": _ints_outside(0, 1024),
    "entries[0].slot": _ints_outside(0, 512),
    "entries[0].tokens": _ints_outside(0, 2**53),
    "entries[0].request_id": _NOT_IDENTIFIER.filter(lambda value: value is not None),
}


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), field=st.sampled_from(sorted(RECORD_ARGS)))
def test_any_bad_record_argument_is_refused_before_redis(buf: SignalBuffer, data: st.DataObject, field: str) -> None:
    value = data.draw(RECORD_ARGS[field], label=field)
    call: dict[str, Any] = {"instance": "p0", "rank": 0, "layer": 0}
    entry: list[Any] = [1, 10, "req-1"]
    if field.startswith("entries"):
        entry[["entries[0].slot", "entries[0].tokens", "entries[0].request_id"].index(field)] = value
    else:
        call[field] = value
    before = keys_now(buf)
    sent: list[object] = []
    original = buf._run_script
    buf._run_script = lambda c: sent.append(c) or original(c)  # type: ignore[method-assign]
    try:
        with pytest.raises(InvalidSignal) as err:
            buf.record(call["instance"], call["rank"], call["layer"], [tuple(entry)])
    finally:
        buf._run_script = original  # type: ignore[method-assign]
    assert (err.value.field, err.value.value) == (field, value)
    assert f"field {field}={value!r}: must be " in str(err.value)
    assert sent == [] and keys_now(buf) <= before
