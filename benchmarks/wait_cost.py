"""What ``wait_replicas`` costs: record and register latency with and without WAIT.

Starts its own primary and replica (free ports, temp dirs, never the machine's 6379), with
persistence off or AOF ``appendfsync always``, and prints a Markdown table of p50/p99 latency
and calls per second for each case. Usage::

    .venv/bin/python benchmarks/wait_cost.py [--calls 2000]
"""

from __future__ import annotations

import argparse
import contextlib
import time
import uuid
from collections.abc import Iterator

from redis_layer_signals import CacheTask, SignalBuffer
from redis_layer_signals.bench.server import LocalRedis
from redis_layer_signals.bench.timing import summarize

AOF_ALWAYS = ["--appendonly", "yes", "--appendfsync", "always"]
NO_PERSISTENCE = ["--appendonly", "no"]
FAST_SYNC = ["--repl-diskless-sync-delay", "0"]


@contextlib.contextmanager
def primary_with_replica(persistence: list[str]) -> Iterator[str]:
    primary = LocalRedis([*FAST_SYNC, *persistence])
    replica = LocalRedis([*FAST_SYNC, *persistence, "--replicaof", "127.0.0.1", str(primary.port)])
    with primary as url, replica:
        client = replica.client()
        for _ in range(500):
            if client.info("replication").get("master_link_status") == "up":
                break
            time.sleep(0.02)
        client.close()
        yield url


def measure(url: str, wait_replicas: int, operation: str, batch: int, calls: int) -> tuple[float, float, float]:
    """(p50 µs, p99 µs, calls/s) of ``calls`` sequential calls."""
    buf = SignalBuffer.from_url(url, namespace=f"bench-{uuid.uuid4().hex[:6]}", env={}, wait_replicas=wait_replicas)
    samples = []
    for i in range(calls):
        slot = i % 512
        started = time.perf_counter_ns()
        if operation == "record":
            buf.record("p0", 0, i % 61, [((slot + j) % 512, 100) for j in range(batch)])
        else:
            buf.register(CacheTask("p0", 0, slot, f"r{i}", 4096, 61), replace=True)
        samples.append(time.perf_counter_ns() - started)
    buf.close()
    summary = summarize(samples, 1, sum(samples) / 1e9)
    return summary.p50_us, summary.p99_us, summary.throughput


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    print("| persistence | operation | wait_replicas | p50 µs | p99 µs | calls/s |")
    print("|---|---|---|---|---|---|")
    for label, persistence in (("none", NO_PERSISTENCE), ("AOF always", AOF_ALWAYS)):
        with primary_with_replica(persistence) as url:
            for operation, batch in (("record", 1), ("record", 64), ("register", 1)):
                for wait in (0, 1):
                    measure(url, wait, operation, batch, max(50, args.calls // 10))  # warm up, load scripts
                    p50, p99, rate = measure(url, wait, operation, batch, args.calls)
                    name = f"{operation} x{batch}" if operation == "record" else operation
                    print(f"| {label} | {name} | {wait} | {p50:.0f} | {p99:.0f} | {rate:.0f} |")
    print(f"\n{args.calls} sequential calls per case on one client, primary and replica on this machine.")


if __name__ == "__main__":
    main()
