"""docker-compose.yml cannot rot: Debian's docker-compose validates it, and every profile's
services run here as local processes against the same topology, started with the compose file's
own commands, arguments and environment (no Docker engine needed): one Redis, a 3-primary
Cluster with replicas made by the file's own `redis-cli --cluster create` service, a Sentinel
group, and the observability stack (the exporter, and Debian's Prometheus with the file's
arguments, scraping it and loading the rules)."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

import redis_layer_signals
from redis_layer_signals import CacheTask, SignalBuffer
from tests.compose_local import REDIS_PORT, ROOT, Addresses, LocalServices, profile_services, redis_args
from tests.servers import RedisServer, free_port, require_binary, wait_until
from tests.topology import free_cluster_port, replication

COMPOSE = ROOT / "docker-compose.yml"
RUN_TIMEOUT_S = 180
STACK = ("registrar", "node-p0", "node-p1")
"""The registrar and the nodes every topology profile runs, under its own prefix."""
PROFILES = {None: "", "cluster": "cluster-", "sentinel": "sentinel-"}
"""Topology profile -> the prefix of its services' names."""


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    """The file as docker-compose resolves it (anchors merged, values normalised)."""
    done = subprocess.run(
        [require_binary("docker-compose"), "-f", str(COMPOSE), "config"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin"},  # no RLS_METRICS_REDIS_URL: the file's default
    )
    assert done.returncode == 0, done.stderr
    config: dict[str, Any] = yaml.safe_load(done.stdout)
    return config


@pytest.fixture
def addresses() -> Addresses:
    return Addresses()


@pytest.fixture
def local(compose: dict[str, Any], addresses: Addresses) -> Iterator[LocalServices]:
    services = LocalServices(compose, addresses)
    yield services
    services.cleanup()


@pytest.fixture
def servers() -> Iterator[list[RedisServer]]:
    started: list[RedisServer] = []
    yield started
    for server in started:
        server.cleanup()


def rls_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: s for name, s in compose["services"].items() if s.get("command", [""])[0] == "rls"}


def volume_parts(volume: str) -> tuple[str, str]:
    """``source:target[:mode]`` as docker-compose config writes it (absolute host paths)."""
    source, target = volume.split(":")[:2]
    return source, target


def mount_path(arg: str, target: str, local_dir: Path) -> str:
    """``--flag=<path>`` with a path inside the container's mount ``target`` -> inside ``local_dir``."""
    flag, equals, value = arg.rpartition("=")
    if value == target or value.startswith(target + "/"):
        return f"{flag}{equals}{local_dir}{value[len(target) :]}"
    return arg


def run_stack(local: LocalServices, prefix: str) -> None:
    """The profile's registrar and two nodes; every node must pass its checks."""
    local.start_rls(f"{prefix}registrar")
    nodes = {name: local.start_rls(f"{prefix}{name}") for name in ("node-p0", "node-p1")}
    for name, node in nodes.items():
        stdout, stderr = node.communicate(timeout=RUN_TIMEOUT_S)
        assert node.returncode == 0, f"{prefix}{name}: {stdout}\n{stderr}"
        assert "every layer of every chunk sent exactly once" in stdout, stdout


def test_compose_has_redis_with_aof_a_registrar_and_two_nodes_on_one_namespace(compose: dict[str, Any]) -> None:
    services = compose["services"]
    redis_command = services["redis"]["command"]
    assert redis_command[0] == "redis-server"
    assert redis_command[redis_command.index("--appendonly") + 1] == "yes"
    default = rls_services({"services": profile_services(compose, None)})
    assert sorted(default) == ["node-p0", "node-p1", "registrar"]
    assert [default[n]["command"][1] for n in ("node-p0", "node-p1", "registrar")] == ["node", "node", "registrar"]
    assert {s["environment"]["RLS_NAMESPACE"] for s in rls_services(compose).values()} == {"cluster"}
    assert {s["environment"]["RLS_REDIS_URL"] for s in default.values()} == {"redis://redis:6379/0"}
    for service in default.values():
        assert service["depends_on"]["redis"]["condition"] == "service_healthy"


def test_every_topology_profile_runs_the_same_registrar_and_nodes(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for profile, prefix in PROFILES.items():
        members = profile_services(compose, profile)
        for name in STACK:
            assert f"{prefix}{name}" in members, (profile, name)
            assert services[f"{prefix}{name}"]["command"] == services[name]["command"], (profile, name)
    # Every service belongs to one topology or to observability: none runs in every profile by mistake.
    for name, service in services.items():
        assert len(service.get("profiles", [])) <= 1, name
    assert {p for s in services.values() for p in s.get("profiles", [])} == {"cluster", "sentinel", "observability"}
    cluster_url = services["cluster-registrar"]["environment"]["RLS_REDIS_URL"]
    assert cluster_url.startswith("redis+cluster://")
    assert services["sentinel-registrar"]["environment"]["RLS_REDIS_URL"].startswith("redis+sentinel://")
    primaries = [n for n in services if n.startswith("cluster-redis-")]
    assert len(primaries) == 6  # 3 primaries with one replica each
    assert services["cluster-create"]["environment"]["CLUSTER_REPLICAS"] == "1"


PINNED = re.compile(r"^[\w./-]+:v?\d+\.\d+\.\d+(-[\w.-]+)?$")
"""An image reference with a full version tag: no floating ``latest`` or ``7.0``."""


def test_every_image_is_pinned_and_the_rls_services_share_one_built_image(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name, service in services.items():
        assert PINNED.match(service["image"]), (name, service["image"])
    rls = rls_services(compose)
    assert {s["image"] for s in rls.values()} == {f"redis-layer-signals:{redis_layer_signals.__version__}"}
    for name, service in rls.items():
        assert Path(service["build"]["context"]) == ROOT, name
        assert service["build"]["dockerfile"] == "deploy/Dockerfile", name
        # Installed once in the image: nothing installs at start, no source mounted over it.
        assert "entrypoint" not in service and "volumes" not in service, name
    # The base is a build argument (deploy/images/build.sh passes its own) whose default, the
    # official image, is pinned too.
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert re.findall(r"^FROM (\S+)", dockerfile, re.MULTILINE) == ["${PYTHON_IMAGE}"]
    (base,) = re.findall(r"^ARG PYTHON_IMAGE=(\S+)", dockerfile, re.MULTILINE)
    assert PINNED.match(base), base
    assert {s["build"]["args"]["PYTHON_IMAGE"] for s in rls.values()} == {base}


def test_the_dockerfile_copies_what_the_package_installs_from(tmp_path: Path) -> None:
    """The image's build sees only what deploy/Dockerfile copies (and .dockerignore lets through):
    a wheel built from exactly that installs the package with its Lua library."""
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    sources = [part for line in re.findall(r"^COPY (.+)$", dockerfile, re.MULTILINE) for part in line.split()[:-1]]
    assert "lua" in sources and "redis_layer_signals" in sources, sources
    allowed = {line[1:] for line in (ROOT / ".dockerignore").read_text().splitlines() if line.startswith("!")}
    assert set(sources) <= allowed, set(sources) - allowed
    context = tmp_path / "context"
    for source in sources:
        if (ROOT / source).is_dir():
            shutil.copytree(ROOT / source, context / source, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            context.mkdir(exist_ok=True)
            shutil.copy(ROOT / source, context / source)
    wheel_command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    subprocess.run(
        [*wheel_command, "-w", str(tmp_path), str(context)],
        check=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("redis_layer_signals-*.whl")
    assert wheel.name.startswith(f"redis_layer_signals-{redis_layer_signals.__version__}-")


def test_cluster_create_gives_up_on_a_node_that_never_answers(
    compose: dict[str, Any], local: LocalServices, servers: list[RedisServer]
) -> None:
    """Every wait of the one-shot service is bounded: a node that accepts connections but never
    answers (stopped) fails it within CLUSTER_WAIT_S and the per-call bound, instead of hanging."""
    server = RedisServer(args=["--cluster-enabled", "yes"], port=free_cluster_port(set()))
    servers.append(server.start())
    assert server.process is not None
    server.process.send_signal(signal.SIGSTOP)
    try:
        nodes = " ".join([f"127.0.0.1:{server.port}"] * 3)
        create = local.start_shell("cluster-create", CLUSTER_NODES=nodes, CLUSTER_REPLICAS="0", CLUSTER_WAIT_S="3")
        # 5 s for the first `cluster info`, 3 s for the create, margin for a loaded machine.
        assert create.wait(timeout=30) != 0, local.output(create)
    finally:
        server.process.send_signal(signal.SIGCONT)


def test_default_profile_runs_as_local_processes_and_every_node_passes(
    compose: dict[str, Any], local: LocalServices, addresses: Addresses, servers: list[RedisServer]
) -> None:
    server = RedisServer(args=redis_args(compose["services"]["redis"], addresses))
    servers.append(server.start())
    addresses.add("redis", REDIS_PORT, server.port)
    with server.client() as client:
        assert client.config_get("appendonly") == {"appendonly": "yes"}
    run_stack(local, PROFILES[None])

    inspect = subprocess.run(
        [sys.executable, "-m", "redis_layer_signals", "inspect", "--json"],
        env=local.environment("registrar"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert inspect.returncode == 0, inspect.stderr
    shot = json.loads(inspect.stdout)
    assert shot["namespace"] == "cluster" and shot["tasks"] == [] and shot["pending"] == []
    with server.client() as client:
        stats = client.hgetall("rls:{cluster/p0/0}:stats")
    assert int(stats[b"registered"]) > 0


def test_cluster_profile_creates_the_cluster_with_its_own_service_and_every_node_passes(
    compose: dict[str, Any], local: LocalServices, addresses: Addresses, servers: list[RedisServer]
) -> None:
    services = compose["services"]
    names = sorted(n for n in profile_services(compose, "cluster") if n.startswith("cluster-redis-"))
    taken: set[int] = set()
    for name in names:
        server = RedisServer(args=redis_args(services[name], addresses), port=free_cluster_port(taken))
        servers.append(server.start())
        addresses.add(name, REDIS_PORT, server.port)
    nodes = " ".join(addresses.localize(f"{n}:{REDIS_PORT}") for n in names)
    create = local.start_shell("cluster-create", CLUSTER_NODES=nodes)
    assert create.wait(timeout=90) == 0, local.output(create)
    assert "All 16384 slots covered" in local.output(create)
    primaries = [s for s in servers if replication(s)["role"] == "master"]
    assert len(primaries) == 3
    assert all(int(replication(p)["connected_slaves"]) >= 1 for p in primaries)

    run_stack(local, PROFILES["cluster"])

    # The ranks' keys hash to slots on more than one primary: the nodes really ran on the Cluster.
    owners = set()
    for server in primaries:
        with server.client() as client:
            if any(True for _ in client.scan_iter(match="rls:{cluster/*}:stats", count=1000)):
                owners.add(server.port)
    assert len(owners) >= 2, owners


def test_sentinel_profile_runs_the_group_and_every_node_passes(
    compose: dict[str, Any], local: LocalServices, addresses: Addresses, servers: list[RedisServer]
) -> None:
    services = compose["services"]
    primary = RedisServer(args=redis_args(services["sentinel-redis-1"], addresses))
    servers.append(primary.start())
    addresses.add("sentinel-redis-1", REDIS_PORT, primary.port)
    replica = RedisServer(args=redis_args(services["sentinel-redis-2"], addresses))
    servers.append(replica.start())
    wait_until(lambda: replication(replica)["master_link_status"] == "up", timeout=30, what="replica in sync")

    sentinel_names = sorted(n for n in profile_services(compose, "sentinel") if n.startswith("sentinel-") and
                            n[len("sentinel-"):].isdigit())  # fmt: skip
    assert len(sentinel_names) == 3
    for name in sentinel_names:
        port = free_port()
        container_port = int(services[name]["environment"]["SENTINEL_PORT"])
        addresses.add(name, container_port, port)
        local.start_shell(name, SENTINEL_PORT=str(port), PRIMARY_HOST="127.0.0.1", PRIMARY_PORT=str(primary.port))
    service = services["sentinel-1"]["environment"]["SENTINEL_SERVICE"]
    for name in sentinel_names:
        port = addresses.ports[(name, int(services[name]["environment"]["SENTINEL_PORT"]))]
        sentinel = redis.Redis(host="127.0.0.1", port=port, decode_responses=True, socket_timeout=5)
        wait_until(lambda s=sentinel: s.sentinel_get_master_addr_by_name(service)[1] == primary.port,
                   timeout=30, what=f"{name} naming the primary")  # fmt: skip
        sentinel.close()

    run_stack(local, PROFILES["sentinel"])

    # Written through the sentinels' primary, and replicated.
    with replica.client() as on_replica, primary.client() as on_primary:
        wait_until(lambda: on_replica.hget("rls:{cluster/p0/0}:stats", "registered") is not None,
                   timeout=30, what="the counters on the replica")  # fmt: skip
        assert int(on_primary.hget("rls:{cluster/p0/0}:stats", "registered") or 0) > 0


@pytest.mark.prometheus
def test_observability_profile_exporter_and_prometheus_run_as_the_file_starts_them(
    compose: dict[str, Any], local: LocalServices, addresses: Addresses, servers: list[RedisServer]
) -> None:
    services = compose["services"]
    server = RedisServer(args=redis_args(services["redis"], addresses))
    servers.append(server.start())
    addresses.add("redis", REDIS_PORT, server.port)
    # Some traffic first, so the exporter has ranks to report.
    with SignalBuffer.from_url(server.url, namespace="cluster", env={}) as buf:
        buf.record("p0", 0, 0, [(1, 100)])
        buf.register(CacheTask("p0", 0, 1, "r1", need_prefill_tokens=100, num_layers=1))

    exporter_port = free_port()
    metrics_args = services["rls-metrics"]["command"]
    container_port = int(metrics_args[metrics_args.index("--port") + 1])
    addresses.add("rls-metrics", container_port, exporter_port)
    metrics_service = dict(services["rls-metrics"])
    metrics_service["command"] = [*metrics_args, "--port", str(exporter_port), "--host", "127.0.0.1"]
    local.services = {**services, "rls-metrics": metrics_service}
    local.start_rls("rls-metrics")

    prometheus = services["prometheus"]
    workdir = Path(tempfile.mkdtemp(prefix="rls-prometheus-"))
    try:
        args = [str(a) for a in prometheus["command"]]
        for source, target in map(volume_parts, prometheus["volumes"]):
            local_dir = workdir / target.strip("/").replace("/", "_")
            if source.startswith("/"):  # a bind mount: a copy whose scrape targets point at this machine
                shutil.copytree(source, local_dir)
                for path in local_dir.rglob("*.yml"):
                    path.write_text(addresses.localize(path.read_text()))
            else:
                local_dir.mkdir()
            args = [mount_path(a, target, local_dir) for a in args]
        web_port = free_port()
        command = [require_binary("prometheus"), *args, f"--web.listen-address=127.0.0.1:{web_port}"]
        process = local.popen(command, local.base_env, cwd=workdir)
        api = f"http://127.0.0.1:{web_port}/api/v1"

        def get(path: str) -> Any:
            with urllib.request.urlopen(f"{api}/{path}", timeout=5) as response:
                return json.loads(response.read())["data"]

        def scraped() -> bool:
            targets = get("targets")["activeTargets"]
            return len(targets) == 1 and targets[0]["health"] == "up"

        wait_until(scraped, timeout=45, interval=0.5, what="prometheus scraping rls metrics")
        assert process.poll() is None
        rules = {r["name"] for group in get("rules")["groups"] for r in group["rules"]}
        expected = {r["alert"] for path in (ROOT / "deploy" / "prometheus" / "rules").glob("*.yml")
                    for g in yaml.safe_load(path.read_text())["groups"] for r in g["rules"]}  # fmt: skip
        assert rules == expected
        # honor_labels keeps the exporter's own instance label (the prefill instance).
        query = urllib.parse.quote('rls_registered_total{namespace="cluster"}')
        result = get(f"query?query={query}")["result"]
        assert [(r["metric"]["instance"], r["metric"]["rank"], r["value"][1]) for r in result] == [("p0", "0", "1")]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def test_grafana_provisioning_points_at_the_profile_prometheus_and_dashboards(compose: dict[str, Any]) -> None:
    services = compose["services"]
    grafana = services["grafana"]
    mounts = {target: Path(source) for source, target in map(volume_parts, grafana["volumes"])}
    provisioning = mounts["/etc/grafana/provisioning"]
    sources = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert [s["url"] for s in sources] == ["http://prometheus:9090"]
    assert "prometheus" in services and "observability" in services["prometheus"]["profiles"]
    providers = yaml.safe_load((provisioning / "dashboards" / "redis-layer-signals.yml").read_text())["providers"]
    dashboards_dir = providers[0]["options"]["path"]
    assert mounts[dashboards_dir] == ROOT / "deploy" / "grafana" / "dashboards"
    assert any(mounts[dashboards_dir].glob("*.json"))
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (mounts[dashboards_dir] / Path(home).name).is_file() and home.startswith(dashboards_dir)
