"""decode_kv_signal on paddle tensors and numpy arrays: the layout, the empty read and every
malformed buffer, each refused with InvalidSignal naming the field."""

from __future__ import annotations

import queue
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

from redis_layer_signals import InvalidSignal
from redis_layer_signals.fastdeploy import KV_SIGNAL_LENGTH, KvSignal, decode_kv_signal
from redis_layer_signals.fastdeploy.demo.scripted import ScriptedGpu, load_paddle
from redis_layer_signals.fastdeploy.signals import KV_SIGNAL_HEADER, encode_kv_signal

paddle = load_paddle()
if paddle is None:  # the demo runs without it; these tests decode real paddle tensors
    raise ModuleNotFoundError("tests/test_fastdeploy_signals.py needs paddle: pip install -e '.[dev,paddle]'")


def layout(count: int, layer: int, entries: Sequence[tuple[int, int, int]] = (), length: int = KV_SIGNAL_LENGTH) -> Any:
    values = np.full(length, -1, dtype=np.int32)
    values[0] = count
    if length > 1:
        values[1] = layer
    for i, entry in enumerate(entries):
        values[2 + 3 * i : 5 + 3 * i] = entry
    return values


def as_paddle(values: Any) -> Any:
    return paddle.to_tensor(values, place=paddle.CPUPlace())


KINDS: dict[str, Callable[[Any], Any]] = {"numpy": lambda v: v, "paddle": as_paddle}


@pytest.fixture(params=sorted(KINDS))
def wrap(request: pytest.FixtureRequest) -> Callable[[Any], Any]:
    return KINDS[request.param]


def test_decode_gives_layer_and_offset_plus_len_per_slot(wrap: Callable[[Any], Any]) -> None:
    data = wrap(layout(2, 7, [(5, 2048, 512), (9, 0, 300)]))
    assert decode_kv_signal(data) == KvSignal(7, ((5, 2560), (9, 300)))


def test_no_signal_decodes_to_none(wrap: Callable[[Any], Any]) -> None:
    assert decode_kv_signal(wrap(layout(-1, 0))) is None


def test_zero_tasks_is_a_signal_without_entries(wrap: Callable[[Any], Any]) -> None:
    assert decode_kv_signal(wrap(layout(0, 3))) == KvSignal(3, ())


def test_a_full_buffer_of_512_entries_decodes(wrap: Callable[[Any], Any]) -> None:
    entries = [(slot, slot, 1) for slot in range(512)]
    signal = decode_kv_signal(wrap(layout(512, 0, entries)))
    assert signal is not None and signal.entries == tuple((slot, slot + 1) for slot in range(512))


def test_prefilled_tokens_past_int32_do_not_wrap(wrap: Callable[[Any], Any]) -> None:
    top = np.iinfo(np.int32).max
    signal = decode_kv_signal(wrap(layout(1, 0, [(1, top, top)])))
    assert signal is not None and signal.entries == ((1, 2 * top),)


def test_scripted_gpu_tensor_is_a_cpu_int32_paddle_tensor_that_round_trips() -> None:
    gpu = ScriptedGpu(queue.Queue(), num_layers=1)
    tensor = gpu.signal_tensor(4, [(3, 128, 64), (8, 0, 17)])
    assert isinstance(tensor, paddle.Tensor) and tensor.dtype == paddle.int32
    assert tensor.shape == [KV_SIGNAL_LENGTH] and tensor.place.is_cpu_place()
    assert decode_kv_signal(tensor) == KvSignal(4, ((3, 192), (8, 17)))


@pytest.mark.parametrize(
    ("values", "field"),
    [
        (layout(-2, 0), "tasks_count"),
        (layout(-(2**31), 0), "tasks_count"),
        (layout(513, 0), "tasks_count"),
        (layout(1, 0, length=1), "length"),
        (np.array([], dtype=np.int32), "length"),
        (layout(2, 0, [(1, 0, 8)], length=7), "length"),
        (layout(1, -1, [(1, 0, 8)]), "layer_id"),
        (layout(1, 0, [(-1, 0, 8)]), "entries[0].engine_idx"),
        (layout(2, 0, [(1, 0, 8), (512, 0, 8)]), "entries[1].engine_idx"),
        (layout(1, 0, [(1, -64, 8)]), "entries[0].chunk_token_offset"),
        (layout(1, 0, [(1, 0, -8)]), "entries[0].current_seq_len"),
        (layout(1, 0, [(1, 0, 8)]).astype(np.int64), "dtype"),
        (layout(1, 0, [(1, 0, 8)]).astype(np.float32), "dtype"),
        (layout(1, 0, [(1, 0, 8)]).reshape(2, -1), "shape"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_malformed_buffer_raises_invalid_signal_naming_the_field(
    wrap: Callable[[Any], Any], values: Any, field: str
) -> None:
    with pytest.raises(InvalidSignal) as caught:
        decode_kv_signal(wrap(values))
    assert isinstance(caught.value, ValueError)
    assert caught.value.field == field
    assert field in str(caught.value)


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ([1, 0, 5, 0, 8], "dtype"),  # a Python list is int64 to numpy: no silent narrowing
        ("1,0,5,0,8", "kv_signal_data"),
        (None, "kv_signal_data"),
        (42, "kv_signal_data"),
    ],
)
def test_non_array_input_raises_invalid_signal(data: Any, field: str) -> None:
    with pytest.raises(InvalidSignal) as caught:
        decode_kv_signal(data)
    assert caught.value.field == field


def test_int64_paddle_tensor_is_refused_as_wrong_dtype() -> None:
    with pytest.raises(InvalidSignal) as caught:
        decode_kv_signal(paddle.full([KV_SIGNAL_LENGTH], -1, dtype="int64"))
    assert (caught.value.field, caught.value.value) == ("dtype", "int64")


def test_decode_and_bridge_work_without_paddle_installed() -> None:
    """A fresh interpreter that cannot import paddle still decodes and builds a bridge."""
    code = (
        "import sys, numpy as np\n"
        "sys.modules['paddle'] = None  # any import of paddle now fails\n"
        "from redis_layer_signals import SignalBuffer\n"
        "from redis_layer_signals.fastdeploy import Layer0Bridge, decode_kv_signal\n"
        "from redis_layer_signals.fastdeploy.demo import reference\n"
        "v = np.full(1538, -1, dtype=np.int32); v[:5] = [1, 0, 5, 0, 8]\n"
        "bridge = Layer0Bridge(SignalBuffer.from_url('memory://', env={}), 'p0', 0, num_layers=2)\n"
        "print(bridge.on_kv_signal(v), decode_kv_signal(v))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[] KvSignal(layer=0, entries=((5, 8),))"


def test_only_layer_skips_other_layers_after_their_header() -> None:
    later = encode_kv_signal(3, [(5, 0, 128)])
    assert decode_kv_signal(later, only_layer=0) is None
    assert decode_kv_signal(later, only_layer=3) == decode_kv_signal(later)
    later[KV_SIGNAL_HEADER] = -7  # a bad engine_idx in a layer nobody asked for is not read
    assert decode_kv_signal(later, only_layer=0) is None
    with pytest.raises(InvalidSignal):
        decode_kv_signal(later)
    broken_header = encode_kv_signal(3, [(5, 0, 128)])
    broken_header[1] = -1  # the header is still checked for every layer
    with pytest.raises(InvalidSignal):
        decode_kv_signal(broken_header, only_layer=0)
