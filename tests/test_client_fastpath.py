"""The client's fast paths (issue 6) keep what the general paths guarantee: the plain batch check
accepts only what the full check accepts, tokens are unique per call and per forked process,
the retry budget counts from the call's start, cached validation still refuses look-alikes,
and results equal the ones the public dataclasses' constructors build."""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings
from redis.exceptions import ConnectionError as RedisConnectionError

from redis_layer_signals import (
    AsyncSignalBuffer,
    BufferUnavailable,
    CacheTask,
    DropReason,
    FinishResult,
    InvalidSignal,
    InvalidTask,
    LayerSignal,
    RecordResult,
    RegisterResult,
    SignalBuffer,
    validation,
)
from redis_layer_signals.config import BufferConfig
from redis_layer_signals.protocol.calls import Protocol, ScriptCall, encode_task, new_token, pack_entries, plain_batch

NUMBERS = st.one_of(
    st.integers(-3, 600),
    st.integers(2**53 - 2, 2**53 + 1),
    st.booleans(),
    st.floats(0, 10),
    st.just("1"),
)
ENTRY = st.one_of(
    st.tuples(NUMBERS, NUMBERS),
    st.tuples(NUMBERS, NUMBERS, st.one_of(st.none(), st.just("req-1"), st.just("a b"))),
    st.lists(NUMBERS, min_size=1, max_size=3),
    st.tuples(NUMBERS),
    st.just(None),
)
BATCH = st.one_of(
    st.lists(st.tuples(st.integers(0, 511), st.integers(0, 2**53 - 1)), max_size=20),  # mostly plain
    st.lists(ENTRY, max_size=6),
    st.lists(ENTRY, max_size=6).map(tuple),
    st.integers(500, 520).map(lambda n: [(1, 1)] * n),
)


@settings(max_examples=400, deadline=None)
@given(raw=BATCH)
def test_plain_batch_accepts_a_subset_of_the_full_check_and_packs_the_same(raw: Any) -> None:
    plain = plain_batch(raw, 512)
    try:
        full = validation.entries(raw, 512)
    except InvalidSignal:
        assert plain is None
        return
    if plain is not None:
        assert [(slot, tokens, None) for slot, tokens in plain] == full
        assert pack_entries(plain) == pack_entries(full)
        slots = "".join(f"{slot}," for slot, _tokens in plain)
        assert pack_entries(plain) == (slots, "".join(f"{tokens},;" for _slot, tokens in plain))


def test_token_is_16_hex_digits_and_new_per_call() -> None:
    tokens = [new_token() for _ in range(1000)]
    assert all(re.fullmatch(r"[0-9a-f]{16}", token) for token in tokens)
    assert len(set(tokens)) == len(tokens)
    protocol = Protocol(BufferConfig.resolve({}, namespace="fast"))
    calls = [protocol.record("p0", 0, 0, [(1, 1)]).call for _ in range(3)]
    reply_keys = [call.keys[4] for call in calls if call is not None]  # keys[5] of record.lua
    assert len(set(reply_keys)) == 3


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_draws_other_tokens_than_its_parent() -> None:
    new_token()  # the parent's generator has state before the fork
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: send its next tokens and leave at once
        try:
            os.write(write, ",".join(new_token() for _ in range(4)).encode())
        finally:
            os._exit(0)
    os.close(write)
    parent = [new_token() for _ in range(4)]
    with os.fdopen(read) as pipe:
        child = pipe.read().split(",")
    os.waitpid(pid, 0)
    assert len(child) == 4 and not set(child) & set(parent)


def test_random_seed_in_the_application_does_not_repeat_tokens() -> None:
    import random

    random.seed(7)
    first = new_token()
    random.seed(7)
    assert new_token() != first


def slow_then_failing(buf: SignalBuffer | AsyncSignalBuffer, first_s: float) -> list[float]:
    """Every attempt fails; the first after ``first_s`` (a timeout), later ones at once."""
    attempts: list[float] = []

    def fail(call: ScriptCall) -> Any:
        attempts.append(time.monotonic())
        if len(attempts) == 1:
            time.sleep(first_s)
        raise RedisConnectionError("injected")

    if isinstance(buf, AsyncSignalBuffer):

        async def async_fail(call: ScriptCall) -> Any:
            return fail(call)

        buf._run_script = async_fail  # type: ignore[method-assign]
    else:
        buf._run_script = fail  # type: ignore[method-assign]
    return attempts


def test_retry_budget_counts_from_the_call_start_when_the_first_attempt_is_slow() -> None:
    buf = SignalBuffer.from_url("memory://fast-budget", namespace="fast", retry_s=0.5, env={})
    attempts = slow_then_failing(buf, 0.3)
    started = time.monotonic()
    with pytest.raises(BufferUnavailable) as err:
        buf.record("p0", 0, 0, [(5, 1)])
    elapsed = time.monotonic() - started
    assert isinstance(err.value.__cause__, RedisConnectionError)
    assert len(attempts) > 1  # it did resend after the slow first attempt
    assert 0.5 <= elapsed < 0.5 + 0.2  # not 0.3 + 0.5: the budget began with the call
    buf.close()


async def test_async_retry_budget_counts_from_the_call_start() -> None:
    buf = AsyncSignalBuffer.from_url("memory://fast-budget-async", namespace="fast", retry_s=0.5, env={})
    attempts = slow_then_failing(buf, 0.3)
    started = time.monotonic()
    with pytest.raises(BufferUnavailable):
        await buf.finish("p0", 0, 5, "req-1")
    elapsed = time.monotonic() - started
    assert len(attempts) > 1 and 0.5 <= elapsed < 0.5 + 0.2
    await buf.close()


def test_a_failed_first_send_is_resent_with_its_token_and_observed_once() -> None:
    seen: list[tuple[str, float]] = []
    buf = SignalBuffer.from_url(
        "memory://fast-resend", namespace="fast", env={}, observer=lambda op, s: seen.append((op, s))
    )
    original = buf._run_script
    sent: list[ScriptCall] = []

    def once_lost(call: ScriptCall) -> Any:
        sent.append(call)
        if len(sent) == 1:
            raise RedisConnectionError("injected before the script ran")
        return original(call)

    buf._run_script = once_lost  # type: ignore[method-assign]
    assert buf.record("p0", 0, 0, [(5, 1)]).buffered
    assert len(sent) == 2 and sent[0] is sent[1]
    assert [op for op, _s in seen] == ["record"] and seen[0][1] > 0
    buf.close()


@pytest.mark.parametrize("look_alike", [False, True, 0.0, 1.0])
def test_cached_rank_validation_still_refuses_look_alikes_of_a_valid_rank(look_alike: Any) -> None:
    buf = SignalBuffer.from_url("memory://fast-cache", namespace="fast", env={})
    buf.record("p0", 0, 0, [(5, 1)])  # ("p0", 0) validated and cached
    buf.finish("p0", 1, 5, "req-1")  # ("p0", 1) too
    with pytest.raises(InvalidSignal) as err:
        buf.record("p0", look_alike, 0, [(5, 1)])
    assert err.value.field == "rank"
    with pytest.raises(InvalidTask) as task_err:
        buf.finish("p0", look_alike, 5, "req-1")
    assert task_err.value.field == "rank"
    with pytest.raises(InvalidSignal, match="instance"):
        buf.record(b"p0", 0, 0, [(5, 1)])  # type: ignore[arg-type]
    buf.close()


def test_results_equal_what_the_public_constructors_build() -> None:
    protocol = Protocol(BufferConfig.resolve({}, namespace="fast"))
    record = protocol.record("p0", 2, 3, [(5, 10), (6, 20, "req-1")]).parse(b"ok|77|DB")
    assert record == RecordResult(
        delivered=[LayerSignal("p0", 2, 5, 3, 10, None, 77)], buffered=[LayerSignal("p0", 2, 6, 3, 20, "req-1", 77)]
    )
    plain = protocol.record("p0", 2, 3, [(5, 10), (6, 20), (7, 30)]).parse("ok|77|BDB")
    assert [(s.slot, s.tokens, s.request_id) for s in plain.buffered] == [(5, 10, None), (7, 30, None)]
    assert [s.slot for s in plain.delivered] == [6]
    assert vars(plain.delivered[0]) == vars(LayerSignal("p0", 2, 6, 3, 20, None, 77))
    assert list(vars(plain.delivered[0])) == list(vars(LayerSignal("p0", 2, 6, 3, 20, None, 77)))
    assert protocol.record("p0", 2, 3, []).parse(None) == RecordResult([], [])
    assert protocol.record("p0", 2, 3, [(5, 10)]).parse(b"ok|9|D") == RecordResult(
        [LayerSignal("p0", 2, 5, 3, 10, None, 9)], []
    )
    task = CacheTask("p0", 2, 5, "req-1", need_prefill_tokens=64, num_layers=4)
    registered = protocol.register(task).parse(b"again|9|0,10,,7,;1,99,,8,over_need;")
    signal = LayerSignal("p0", 2, 5, 0, 10, None, 7)
    over = LayerSignal("p0", 2, 5, 1, 99, None, 8)
    assert registered == RegisterResult(task, [signal], [(over, DropReason.OVER_NEED)], repeated=True)
    assert hash(registered.recovered[0]) == hash(signal)
    assert protocol.finish("p0", 2, 5, "req-1").parse(b"ok|9|1,3,0") == FinishResult(True, 3, False)
    with pytest.raises(ValueError, match="1 flags for 2 entries"):
        protocol.record("p0", 2, 3, [(5, 10), (6, 20)]).parse(b"ok|9|D")


def test_task_document_is_the_text_json_dumps_writes() -> None:
    task = CacheTask("p0", 0, 5, "req-1", 64, 4, 3, meta={"z": "é", "a": '"q"'})
    document = {
        "request_id": "req-1",
        "need_prefill_tokens": 64,
        "num_layers": 4,
        "decode_cached_tokens": 3,
        "meta": {"z": "é", "a": '"q"'},
    }
    assert encode_task(task) == json.dumps(document, separators=(",", ":"), sort_keys=True)


@given(
    request_id=st.from_regex(r"[A-Za-z0-9._-]{1,128}", fullmatch=True),
    need=st.integers(0, 2**53 - 1),
    layers=st.integers(1, 2**53 - 1),
    cached=st.integers(0, 2**53 - 1),
    meta=st.one_of(st.just({}), st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2)),
)
def test_task_document_of_any_valid_task_is_the_text_json_dumps_writes(
    request_id: str, need: int, layers: int, cached: int, meta: dict[str, str]
) -> None:
    """The f-string written for a task without meta and the encoder agree on every valid task."""
    task = CacheTask("p0", 0, 5, request_id, need, layers, cached, meta=meta)
    Protocol(BufferConfig.resolve({}, max_layers=2**53 - 1)).task_keys(task)  # only validated tasks are encoded
    document = {
        "request_id": request_id,
        "need_prefill_tokens": need,
        "num_layers": layers,
        "decode_cached_tokens": cached,
        "meta": meta,
    }
    assert encode_task(task) == json.dumps(document, separators=(",", ":"), sort_keys=True)


def test_async_buffer_round_trip_on_the_fast_path() -> None:
    async def run() -> None:
        buf = AsyncSignalBuffer.from_url("memory://fast-async", namespace="fast", env={})
        assert [s.slot for s in (await buf.record("p0", 0, 0, [(5, 1), (6, 2)])).buffered] == [5, 6]
        await buf.close()

    asyncio.run(run())
