"""FastDeploy integration: decode ``kv_signal_data`` and serve ``CacheMessagerV1``'s hook points.

``decode_kv_signal`` and ``Layer0Bridge`` need numpy only; paddle is imported lazily, by the
scripted GPU of the reference messager (``reference``, ``scripted``), never here.
"""

from .bridge import Batch, Layer0Bridge
from .messager import bridge_for_messager, instance_name
from .signals import KV_SIGNAL_LENGTH, KV_SIGNAL_MAX_TASKS, KvSignal, decode_kv_signal

__all__ = [
    "KV_SIGNAL_LENGTH",
    "KV_SIGNAL_MAX_TASKS",
    "Batch",
    "KvSignal",
    "Layer0Bridge",
    "bridge_for_messager",
    "decode_kv_signal",
    "instance_name",
]
