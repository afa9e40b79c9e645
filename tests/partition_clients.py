"""Client processes for the partition tests (tests/partition_worker.py on hosts of their own),
and what the accounting measures when something acknowledged was lost."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from redis_layer_signals import SignalBuffer
from redis_layer_signals.transport.deadline import MARGIN_S
from tests.netns import Hosts
from tests.partition_worker import load_logs
from tests.race import SLOTS, Log, ended
from tests.servers import wait_until
from tests.test_race import assert_every_signal_accounted_once

ROOT = Path(__file__).resolve().parent.parent
WAIT_TIMEOUT_MS = 100
LOADED_SLACK_S = 0.65
"""What a loaded 2-core machine may add to a call's documented bound (scheduling, the close of
a connection, the client process's other threads)."""


def call_bound_s(retry_s: float) -> float:
    """The most an attempt may take in these tests: the documented ``retry_s`` + ``MARGIN_S``,
    ``wait_timeout_ms`` (the WAIT path), and ``LOADED_SLACK_S``; the tests add the longest the
    client process's threads waited to run (``max_lag_s`` of :func:`figures_of`)."""
    return retry_s + MARGIN_S + WAIT_TIMEOUT_MS / 1000 + LOADED_SLACK_S


def start_workers(
    hosts: Hosts, url: str, client_hosts: list[str], tmp: Path, spaces: list[str], wait: int, retry_s: float
) -> list[Any]:
    """A client process (tests/partition_worker.py) on each of ``client_hosts``, two threads per
    namespace; returns once each is connected."""
    workers = []
    for index, host in enumerate(client_hosts):
        spec = {
            "url": url,
            "namespaces": spaces,
            "threads": 2,
            "worker_base": (index + 1) * 1000,
            "retry_s": retry_s,
            "wait_replicas": wait,
            "wait_timeout_ms": WAIT_TIMEOUT_MS,
            "reply_ttl_s": 300,
            "seed": 5,
            "stop": str(tmp / "stop"),
            "out": str(tmp / f"{host}.json"),
        }
        path = tmp / f"{host}-spec.json"
        path.write_text(json.dumps(spec))
        command = [*hosts.exec_prefix(host), sys.executable, "-m", "tests.partition_worker", str(path)]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        log = (tmp / f"{host}.err").open("w")
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=log)
        workers.append((host, process, path))
    for _, _, path in workers:
        ready = Path(json.loads(path.read_text())["out"] + ".ready")
        wait_until(ready.exists, timeout=30, what=f"the client process of {path.name} connected")
    return workers


def collect(tmp: Path, workers: list[Any]) -> dict[str, Any]:
    """Stop the client processes and merge their logs and timings per namespace."""
    (tmp / "stop").touch()
    merged: dict[str, Any] = {"logs": {}, "timings": {}}
    for host, process, _ in workers:
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            for other in [p for _, p, _ in workers if p.poll() is None]:
                other.send_signal(signal.SIGUSR1)  # faulthandler: every thread's stack to its log
            time.sleep(1)
            for _, other, _ in workers:
                other.kill()
            stacks = (tmp / f"{host}.err").read_text()[-6000:]
            raise AssertionError(f"the client process on {host} hung:\n{stacks}") from None
        assert process.returncode == 0, (tmp / f"{host}.err").read_text()[-3000:]
        out = json.loads((tmp / f"{host}.json").read_text())
        assert out["errors"] == [], out["errors"]
        for ns, logs in out["logs"].items():
            merged["logs"].setdefault(ns, []).extend(load_logs(logs))
        for ns, timing in out["timings"].items():
            merged["timings"].setdefault(ns, []).append(timing)
    return merged


def shortfall(logs: list[Log], buf: SignalBuffer) -> dict[str, int]:
    """What the counters and the buffer miss of what the clients were told (0 everywhere when
    nothing acknowledged was lost), and what was handed out twice."""
    recorded = [s for log in logs for s in log.recorded]
    buffered = {s for log in logs for s in log.buffered}
    handed_out = [s for log in logs for s in log.delivered + log.recovered + log.dropped]
    pending = [(p.slot, p.layer, p.tokens) for slot in range(SLOTS) for p in buf.pending("p0", 0, slot)]
    stats = buf.stats()
    return {
        "recorded": len(recorded),
        "signals_lost": len(recorded) - stats.get("recorded", 0),
        "registrations_lost": sum(log.registered for log in logs) - stats.get("registered", 0),
        "buffered_unaccounted": len(buffered) - ended(stats) - len(pending),
        "twice": sum(1 for n in Counter(handed_out + pending).values() if n > 1),
    }


def figures_of(result: dict[str, Any], ns: str, process: int | None = None) -> dict[str, Any]:
    """One namespace's slowest attempt, attempts, and attempts that raised BufferUnavailable,
    and the longest the client processes' threads waited to run (tests/partition_worker.py's
    ``LagMeter``: an attempt's bound grows by it); of one client process (its index in the
    client hosts) when given."""
    timings = result["timings"][ns]
    if process is not None:
        timings = timings[process : process + 1]
    return {
        "max_attempt_s": round(max(t["max_s"] for t in timings), 3),
        "slowest": max(timings, key=lambda t: t["max_s"])["max_operation"],
        "attempts": sum(t["attempts"] for t in timings),
        "unavailable": sum(t["unavailable"] for t in timings),
        "last_error": next((t["last_error"] for t in timings if t["last_error"]), ""),
        "max_lag_s": round(max(t["max_lag_s"] for t in timings), 3),
    }


def check_on(hosts: Hosts, host: str, url: str, ns: str, logs: list[Log], exact: bool) -> dict[str, int]:
    """The accounting, from ``host``: exact (the race test's, which raises) or the measured shortfall."""

    def check() -> dict[str, int]:
        buf = SignalBuffer.from_url(url, namespace=ns, env={}, retry_s=10)
        try:
            if exact:
                assert_every_signal_accounted_once(logs, buf)
            return shortfall(logs, buf)
        finally:
            buf.close()

    return hosts.run(host, check)
