"""redis-benchmark on the same server, for reference: what Redis itself sustains here."""

from __future__ import annotations

import csv
import io
import shutil
import subprocess
from typing import Any
from urllib.parse import urlparse

from . import names
from .server import BenchServerError

REDIS_BENCHMARK = "redis-benchmark"
TIMEOUT_S = 120.0


def _target(url: str) -> list[str]:
    parsed = urlparse(url)
    args = ["-h", parsed.hostname or "127.0.0.1", "-p", str(parsed.port or 6379)]
    if parsed.password:
        args += ["-a", parsed.password, "--no-auth-warning"]
        if parsed.username:
            args += ["--user", parsed.username]
    return args


def run(url: str, requests: int, floor_sha: str, clients: tuple[int, ...] = (1, 4)) -> list[dict[str, Any]]:
    """PING, SET and the floor's EVALSHA, each with 1 and 4 clients; CSV parsed into rows.

    Raises when the binary is missing: the benchmark promises this baseline, it does not skip it.
    """
    binary = shutil.which(REDIS_BENCHMARK)
    if binary is None:
        raise BenchServerError(f"{REDIS_BENCHMARK} is not installed (apt-get install redis-tools)")
    rows: list[dict[str, Any]] = []
    commands: list[tuple[str, list[str]]] = [
        ("PING", ["-t", "ping_mbulk"]),
        ("SET", ["-t", "set"]),
        ("EVALSHA floor, 1 entry", ["evalsha", floor_sha, "1", names.floor_key(), "5", "2048"]),
    ]
    for count in clients:
        for name, command in commands:
            argv = [binary, *_target(url), "-n", str(requests), "-c", str(count), "--csv", *command]
            done = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S, check=True)
            for record in csv.DictReader(io.StringIO(done.stdout)):
                rows.append(
                    {
                        "command": name,
                        "clients": count,
                        "rps": float(record["rps"]),
                        "p50_us": float(record["p50_latency_ms"]) * 1000.0,
                        "p99_us": float(record["p99_latency_ms"]) * 1000.0,
                    }
                )
    return rows
