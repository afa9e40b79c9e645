"""docker-compose.yml cannot rot: Debian's docker-compose validates it, and its services'
commands run here as local processes against a redis-server started with the compose file's
own Redis arguments (no Docker engine needed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.servers import RedisServer, require_binary

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
RUN_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    """The file as docker-compose resolves it (anchors merged, values normalised)."""
    done = subprocess.run(
        [require_binary("docker-compose"), "-f", str(COMPOSE), "config"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    config: dict[str, Any] = yaml.safe_load(done.stdout)
    return config


def rls_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: s for name, s in compose["services"].items() if s.get("command", [""])[0] == "rls"}


def test_compose_has_redis_with_aof_a_registrar_and_two_nodes_on_one_namespace(compose: dict[str, Any]) -> None:
    services = compose["services"]
    redis_command = services["redis"]["command"]
    assert redis_command[0] == "redis-server"
    assert redis_command[redis_command.index("--appendonly") + 1] == "yes"
    rls = rls_services(compose)
    assert sorted(rls) == ["node-p0", "node-p1", "registrar"]
    assert [rls[n]["command"][1] for n in ("node-p0", "node-p1", "registrar")] == ["node", "node", "registrar"]
    assert {s["environment"]["RLS_NAMESPACE"] for s in rls.values()} == {"cluster"}
    assert {s["environment"]["RLS_REDIS_URL"] for s in rls.values()} == {"redis://redis:6379/0"}
    for service in rls.values():
        assert service["depends_on"]["redis"]["condition"] == "service_healthy"


def test_compose_services_run_as_local_processes_and_every_node_passes(compose: dict[str, Any]) -> None:
    services = compose["services"]
    server = RedisServer(args=services["redis"]["command"][1:]).start()
    processes: list[subprocess.Popen[str]] = []
    try:
        assert server.client().config_get("appendonly") == {"appendonly": "yes"}
        base_env = {k: v for k, v in os.environ.items() if not k.startswith("RLS_")}

        def start(name: str) -> subprocess.Popen[str]:
            service = services[name]
            env = {**base_env, **service["environment"], "RLS_REDIS_URL": server.url, "COLUMNS": "200"}
            command = [sys.executable, "-m", "redis_layer_signals", *service["command"][1:]]
            process = subprocess.Popen(
                command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            processes.append(process)
            return process

        start("registrar")
        nodes = {name: start(name) for name in ("node-p0", "node-p1")}
        for name, node in nodes.items():
            stdout, stderr = node.communicate(timeout=RUN_TIMEOUT_S)
            assert node.returncode == 0, f"{name}: {stdout}\n{stderr}"
            assert "every layer of every chunk sent exactly once" in stdout, stdout

        env = {**base_env, **services["registrar"]["environment"], "RLS_REDIS_URL": server.url}
        inspect = subprocess.run(
            [sys.executable, "-m", "redis_layer_signals", "inspect", "--json"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert inspect.returncode == 0, inspect.stderr
        shot = json.loads(inspect.stdout)
        assert shot["namespace"] == "cluster" and shot["tasks"] == [] and shot["pending"] == []
        stats = server.client().hgetall("rls:{cluster/p0/0}:stats")
        assert int(stats[b"registered"]) > 0
    finally:
        for process in processes:
            if process.poll() is None:
                process.terminate()
                process.wait(timeout=10)
        server.cleanup()
