"""One tensor-parallel rank in a process of its own, for the group's fault tests: a
``Layer0Bridge`` with ``nranks > 1``, driven by JSON lines on stdin, saying on stdout what its
sender's queue got.

``python -m tests.tp_rank --url URL --namespace NS --rank R --nranks N`` reads commands::

    {"op": "signal", "entries": [[slot, tokens], ...]}    a layer-0 message
    {"op": "task", "slot": 5, "request_id": "a", "need": 300}
    {"op": "finish", "slot": 5, "request_id": "a"}
    {"op": "health", "id": 7}                              answered {"ev": "health", "id": 7, ...}

and writes ``{"ev": "started", "pid": ...}`` once the bridge is built, then
``{"ev": "queued", "batch": [[slot, tokens]]}`` for each batch its queue gets. It logs to stderr
(``LEVEL message``), and closes the bridge at the end of stdin. ``RLS_GROUP_DIR`` comes from
the environment, as a deployment's would.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import queue
import sys
import threading
from typing import Any

from redis_layer_signals import SignalBuffer
from redis_layer_signals.fastdeploy import Layer0Bridge
from redis_layer_signals.fastdeploy.signals import encode_kv_signal


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--instance", default="p0")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--nranks", type=int, required=True)
    parser.add_argument("--pending-ttl-s", type=float, default=60.0)
    args = parser.parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(levelname)s %(message)s")
    out = threading.Lock()

    def say(message: dict[str, Any]) -> None:
        with out:
            sys.stdout.write(json.dumps(message) + "\n")
            sys.stdout.flush()

    buffer = SignalBuffer.from_url(
        args.url, namespace=args.namespace, env={}, pending_ttl_s=args.pending_ttl_s, retry_s=0.5
    )
    ready: queue.Queue[list[tuple[int, int]]] = queue.Queue()
    bridge = Layer0Bridge(buffer, args.instance, args.rank, num_layers=4, ready=ready, nranks=args.nranks, probe_s=0.05)

    def sender() -> None:
        while True:
            say({"ev": "queued", "batch": ready.get()})

    threading.Thread(target=sender, name="sender", daemon=True).start()
    say({"ev": "started", "pid": os.getpid()})
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        if op == "signal":
            bridge.on_kv_signal(encode_kv_signal(0, [(slot, 0, tokens) for slot, tokens in command["entries"]]))
        elif op == "task":
            info = {"request_id": command["request_id"], "current_id": command["slot"]}
            bridge.on_cache_task({**info, "need_prefill_tokens": command["need"]})
        elif op == "finish":
            bridge.on_task_finished(command["slot"], command["request_id"])
        elif op == "health":
            say({"ev": "health", "id": command["id"], **dataclasses.asdict(bridge.health())})
    bridge.close()
    buffer.close()


if __name__ == "__main__":
    main()
