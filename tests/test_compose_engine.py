"""docker-compose.yml for real: every profile brought up by docker-compose on a Docker engine of
the test's own (tests/engine.py), with the images made from Debian's packages by
deploy/images/build.sh, exercised, and torn down. `make cluster-test` runs this module (root);
it prints each step's time and each profile's figures (the nodes' own tables).

- one Redis: nodes p0 and p1 exit 0 and lose nothing;
- Cluster: cluster-create forms 3 primaries with a replica each, the nodes pass, then a primary's
  container is stopped while longer nodes run, a replica takes over and they still pass;
- Sentinel: the nodes pass, then the primary's container is stopped mid-run, the sentinels fail
  over to the replica and the nodes go on and pass;
- observability: Prometheus scrapes `rls metrics` and a query of `rls_recorded_total` returns the
  nodes' series; Grafana only where its image is there (no Debian package makes it).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.compose_local import ROOT
from tests.engine import COMPOSE, Engine, host_network, missing_binaries, sweep
from tests.servers import wait_until

# The first test also waits for the images (debootstrap and four builds on a fresh machine).
pytestmark = [pytest.mark.engine, pytest.mark.timeout(1800)]

ENV_FILE = ROOT / "deploy" / "images" / "debian.env"
DATA_ROOT = Path(os.environ.get("RLS_ENGINE_DATA_ROOT", ROOT / ".cache" / "compose-engine"))
"""Kept between runs (the images): a second run builds only the `rls` image again."""
NODE_TIMEOUT_S = 420
OK_LINE = "OK: every layer of every chunk sent exactly once"
FAILOVER_NODE = ["--ranks", "2", "--requests", "300", "--hang-timeout-s", "60"]
"""A longer run than the file's nodes, so a container can be stopped while it runs; a request
may wait out the failover (the nodes' check is otherwise unchanged)."""
FAILOVER_ENV: list[str] = []
"""The profiles' own RLS_RETRY_S (30 s) carries the calls through the failover."""
GRAFANA_IMAGE = "grafana/grafana:10.4.2"


def say(text: str) -> None:
    print(text, flush=True)


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    if os.geteuid() != 0:
        pytest.fail("make cluster-test needs root: it runs dockerd, debootstrap and a network namespace")
    missing = missing_binaries()
    if missing:
        pytest.fail(f"make cluster-test needs: {', '.join(missing)} (make cluster-engine installs them as root)")
    sweep(DATA_ROOT)  # what an earlier run, killed, left
    before = host_network()
    engine = Engine(DATA_ROOT)
    try:
        started = time.monotonic()
        engine.start(netns=False)
        say(f"\n== images (deploy/images/build.sh, engine data root {DATA_ROOT})")
        built = subprocess.run(
            [str(ROOT / "deploy" / "images" / "build.sh")],
            env=engine.env,
            capture_output=True,
            text=True,
            timeout=1800,
            check=False,
        )
        say(built.stdout.rstrip())
        assert built.returncode == 0, built.stderr[-3000:]
        engine.stop()
        say(f"images ready in {time.monotonic() - started:.0f} s")
        engine.start(netns=True)
        yield engine
    finally:
        engine.close()
        assert engine.processes() == [], "processes of the engine still running"
        assert host_network() == before, "the host's network differs from before the run"
        say("engine stopped: no dockerd or containerd of the run left, host network as before")


class Project:
    """One docker-compose project (its own network and volumes) on the engine."""

    def __init__(self, engine: Engine, name: str, *profiles: str) -> None:
        self.engine = engine
        self.name = name
        self.base = [COMPOSE, "-p", name, "--env-file", str(ENV_FILE), "-f", str(ROOT / "docker-compose.yml")]
        for profile in profiles:
            self.base += ["--profile", profile]

    def run(self, *args: str, timeout: float = 300, check: bool = True) -> str:
        done = subprocess.run(
            [*self.base, *args], env=self.engine.env, capture_output=True, text=True, timeout=timeout, cwd=ROOT
        )
        if check and done.returncode != 0:
            raise AssertionError(f"docker-compose {' '.join(args)}: {done.stdout[-2000:]}\n{done.stderr[-3000:]}")
        return done.stdout

    def container(self, service: str) -> str:
        (cid,) = self.run("ps", "-a", "-q", service).split()
        return cid

    def redis_cli(self, service: str, *args: str) -> str:
        return self.run("exec", "-T", service, "redis-cli", *args).strip()

    def ip(self, service: str) -> str:
        fmt = "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}"
        return self.engine.docker("inspect", "-f", fmt, self.container(service)).stdout.strip()

    def down(self) -> None:
        self.run("down", "-v", "--remove-orphans", timeout=300, check=False)


@pytest.fixture
def project(engine: Engine, request: pytest.FixtureRequest) -> Iterator[list[Project]]:
    made: list[Project] = []
    yield made
    for each in made:
        each.down()


def wait_nodes(engine: Engine, containers: dict[str, str]) -> dict[str, str]:
    """Each node's exit status 0 and its table, the real output printed; returns the logs."""
    logs = {}
    for name, cid in containers.items():
        status = engine.docker("wait", cid, timeout=NODE_TIMEOUT_S).stdout.strip()
        logs[name] = engine.docker("logs", cid).stdout + engine.docker("logs", cid).stderr
        table = [line for line in logs[name].splitlines() if not line.startswith("node ")]
        say(f"-- {name} (exit {status})\n" + "\n".join(table))
        assert status == "0", logs[name][-3000:]
        assert OK_LINE in " ".join(logs[name].split()), logs[name][-3000:]
        assert figure(logs[name], "lost layer-chunks") == "0" and figure(logs[name], "sent twice") == "0"
    return logs


def figure(table: str, name: str) -> str:
    match = re.search(rf"│ {re.escape(name)}\s*│\s*(\S+) │", table)
    assert match, f"{name} not in {table[-2000:]}"
    return match.group(1)


def start_nodes(compose: Project, prefix: str) -> dict[str, str]:
    compose.run("up", "-d", "--no-build", f"{prefix}node-p0", f"{prefix}node-p1")
    return {f"{prefix}node-{n}": compose.container(f"{prefix}node-{n}") for n in ("p0", "p1")}


def start_long_nodes(compose: Project, prefix: str) -> dict[str, str]:
    """The same nodes with a longer workload, as one-off containers of the project."""
    containers = {}
    for n in ("p0", "p1"):
        name = f"{compose.name}_{prefix}failover-{n}"
        args = ["rls", "node", "--instance", n, *FAILOVER_NODE]
        compose.run("run", "-d", "--no-deps", "--name", name, *FAILOVER_ENV, f"{prefix}node-{n}", *args)
        containers[f"{prefix}node-{n} (failover run)"] = name
    return containers


def timed(what: str, started: float) -> None:
    say(f"{what}: {time.monotonic() - started:.0f} s")


def test_one_redis_profile_nodes_exit_0_and_lose_nothing(engine: Engine, project: list[Project]) -> None:
    say("\n== profile (none): one Redis")
    compose = Project(engine, "rls-one")
    project.append(compose)
    started = time.monotonic()
    compose.run("up", "-d", "--no-build", "redis", "registrar")
    timed("redis and registrar up", started)
    assert engine.docker("port", compose.container("redis"), "6379").stdout.split() == ["127.0.0.1:16379"]
    started = time.monotonic()
    wait_nodes(engine, start_nodes(compose, ""))
    timed("nodes p0 and p1", started)
    registered = compose.redis_cli("redis", "hget", "rls:{cluster/p0/0}:stats", "registered")
    assert int(registered) > 0, registered
    assert compose.redis_cli("redis", "config", "get", "appendonly").split() == ["appendonly", "yes"]


def cluster_roles(compose: Project, via: str) -> tuple[list[str], list[str]]:
    lines = compose.redis_cli(via, "cluster", "nodes").splitlines()
    live = [line for line in lines if "fail" not in line.split()[2]]
    primaries = [line for line in live if "master" in line.split()[2] and len(line.split()) > 8]
    replicas = [line for line in live if "slave" in line.split()[2]]
    return primaries, replicas


def test_cluster_profile_forms_3_plus_3_and_a_stopped_primary_loses_nothing(
    engine: Engine, project: list[Project]
) -> None:
    say("\n== profile cluster: 3 primaries, 3 replicas")
    compose = Project(engine, "rls-cluster", "cluster")
    project.append(compose)
    started = time.monotonic()
    compose.run("up", "-d", "--no-build", "cluster-registrar")
    timed("6 nodes healthy, cluster-create done, registrar up", started)
    created = engine.docker("inspect", "-f", "{{.State.ExitCode}}", compose.container("cluster-create"))
    assert created.stdout.strip() == "0"
    # cluster-create returns once the slots are served; a replica's role may reach the node asked
    # a gossip round later, so the roles are read until they show 3+3 (or the wait says what not).
    wait_until(
        lambda: tuple(map(len, cluster_roles(compose, "cluster-redis-1"))) == (3, 3),
        timeout=30,
        interval=0.5,
        what="cluster-redis-1 to see 3 primaries and 3 replicas",
    )
    primaries, replicas = cluster_roles(compose, "cluster-redis-1")
    say(f"cluster formed: {len(primaries)} primaries, {len(replicas)} replicas")
    assert (len(primaries), len(replicas)) == (3, 3)
    started = time.monotonic()
    wait_nodes(engine, start_nodes(compose, "cluster-"))
    timed("nodes p0 and p1", started)

    # A primary's container stopped while longer nodes run: its replica takes over.
    started = time.monotonic()
    containers = start_long_nodes(compose, "cluster-")
    time.sleep(3)
    victim_ip = primaries[0].split()[1].split(":")[0]
    names = [f"cluster-redis-{i}" for i in range(1, 7)]
    victim = next(n for n in names if compose.ip(n) == victim_ip)
    survivor = next(n for n in names if n != victim)
    compose.run("stop", victim)
    say(f"stopped {victim} (primary {victim_ip}) mid-run")

    def promoted() -> bool:
        primaries_now = cluster_roles(compose, survivor)[0]
        return len(primaries_now) == 3 and all(victim_ip not in line.split()[1] for line in primaries_now)

    wait_until(promoted, timeout=90, interval=0.5, what="a replica promoted in the stopped primary's place")
    now, left = cluster_roles(compose, survivor)
    say(f"after the failover: {len(now)} primaries, {len(left)} replicas")
    assert len(left) == 2
    wait_nodes(engine, containers)
    timed("failover run", started)


def test_sentinel_profile_fails_over_when_the_primary_stops_and_the_nodes_go_on(
    engine: Engine, project: list[Project]
) -> None:
    say("\n== profile sentinel: a primary, a replica, three sentinels")
    compose = Project(engine, "rls-sentinel", "sentinel")
    project.append(compose)
    started = time.monotonic()
    compose.run("up", "-d", "--no-build", "sentinel-registrar")
    timed("primary, replica, sentinels and registrar up", started)
    primary_ip, replica_ip = compose.ip("sentinel-redis-1"), compose.ip("sentinel-redis-2")

    def named_primary() -> str:
        reply = compose.redis_cli("sentinel-1", "-p", "26379", "sentinel", "get-master-addr-by-name", "rls-primary")
        return reply.split()[0]

    assert named_primary() == primary_ip
    started = time.monotonic()
    wait_nodes(engine, start_nodes(compose, "sentinel-"))
    timed("nodes p0 and p1", started)

    started = time.monotonic()
    containers = start_long_nodes(compose, "sentinel-")
    time.sleep(3)
    compose.run("stop", "sentinel-redis-1")
    say(f"stopped sentinel-redis-1 (primary {primary_ip}) mid-run")
    wait_until(lambda: named_primary() == replica_ip, timeout=90, interval=0.5, what="the sentinels failing over")
    timed(f"sentinels name sentinel-redis-2 ({replica_ip}) the primary after", started)
    wait_nodes(engine, containers)
    timed("failover run", started)


def test_observability_profile_prometheus_scrapes_the_nodes_series(engine: Engine, project: list[Project]) -> None:
    say("\n== profile observability: rls metrics and Prometheus over the single Redis")
    compose = Project(engine, "rls-observability", "observability")
    project.append(compose)
    grafana = engine.docker("image", "inspect", GRAFANA_IMAGE, check=False).returncode == 0
    services = ["redis", "registrar", "rls-metrics", "prometheus", *(["grafana"] if grafana else [])]
    started = time.monotonic()
    compose.run("up", "-d", "--no-build", *services)
    timed(f"{', '.join(services)} up", started)
    if not grafana:
        say(f"Grafana not run: {GRAFANA_IMAGE} is not on this engine (no registry answers, and Debian has "
            "no grafana package to build it from)")  # fmt: skip
    for service, port in (("rls-metrics", "9108"), ("prometheus", "9090")):
        published = engine.docker("port", compose.container(service), port).stdout.split()
        assert all(p.startswith("127.0.0.1:") for p in published) and published, (service, published)
    wait_nodes(engine, start_nodes(compose, ""))

    api = "http://127.0.0.1:19090/api/v1"
    query = urllib.parse.quote('sum by (instance) (rls_recorded_total{namespace="cluster"})')

    def series() -> dict[str, float]:
        try:
            result = json.loads(engine.fetch(f"{api}/query?query={query}"))["data"]["result"]
        except ConnectionError:
            return {}
        return {r["metric"]["instance"]: float(r["value"][1]) for r in result}

    started = time.monotonic()
    wait_until(lambda: set(series()) == {"p0", "p1"}, timeout=90, interval=1, what="rls_recorded_total for p0 and p1")
    timed("Prometheus holding both nodes' series", started)
    targets = json.loads(engine.fetch(f"{api}/targets"))["data"]["activeTargets"]
    say(f"Prometheus targets: {[(t['scrapeUrl'], t['health']) for t in targets]}")
    say(f"rls_recorded_total by instance: {series()}")
    assert [t["health"] for t in targets] == ["up"]
    assert all(value > 0 for value in series().values())
    if grafana:
        health = json.loads(engine.fetch("http://127.0.0.1:13000/api/health"))
        say(f"Grafana: {health}")
        assert health["database"] == "ok"
