"""deploy/ cannot drift from the exporters: every metric and label the Grafana dashboard and the
Prometheus rules name is one a live exporter serves (read over HTTP, after calls on a real
redis-server, from `BufferMetrics`, what `rls metrics` serves, and from the FastDeploy bridge's
`BridgeMetrics`), and promtool validates the rules, their unit tests and the configuration."""

from __future__ import annotations

import json
import re
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from redis_layer_signals import CacheTask, SignalBuffer
from redis_layer_signals.fastdeploy import Layer0Bridge
from redis_layer_signals.fastdeploy.health import BridgeMetrics
from redis_layer_signals.ops.metrics import BufferMetrics
from tests.servers import RedisServer, require_binary

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
DASHBOARDS = sorted((DEPLOY / "grafana" / "dashboards").glob("*.json"))
RULE_FILES = sorted((DEPLOY / "prometheus" / "rules").glob("*.yml"))
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
RULE_TESTS = sorted((DEPLOY / "prometheus" / "tests").glob("*.test.yml"))

METRIC_NAME = re.compile(r"\b(rls_[a-z0-9_]+)")
LABEL_MATCHER = re.compile(r"\b([a-z_]+)\s*(?:=~|!~|!=|=)\s*\"")
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
SAMPLE_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}]*)\})? ")
BUILTIN_LABELS = {"le"}
"""Labels PromQL itself gives meaning to (histogram buckets)."""


def dashboard_queries(path: Path) -> list[str]:
    """Every PromQL expression of a dashboard: panel targets and template variables."""
    dashboard = json.loads(path.read_text())
    queries = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            queries.append(variable["query"]["query"])
    return queries


def rule_expressions(path: Path) -> list[str]:
    rules = yaml.safe_load(path.read_text())
    return [rule["expr"] for group in rules["groups"] for rule in group["rules"]]


def all_queries() -> list[tuple[str, str]]:
    """(file name, expression) of every dashboard query and every rule."""
    found = [(p.name, q) for p in DASHBOARDS for q in dashboard_queries(p)]
    found += [(p.name, q) for p in RULE_FILES for q in rule_expressions(p)]
    return found


def scrape(render: Any) -> str:
    """One page of an exporter, over HTTP from its own server (``serve(0)``: a free port)."""
    server = render.serve(0, "127.0.0.1")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=10) as response:
            return str(response.read().decode())
    finally:
        server.shutdown()


def sample_labels(page: str) -> dict[str, set[str]]:
    """Sample name -> its label names, from one page of the text format."""
    names: dict[str, set[str]] = {}
    for line in page.splitlines():
        match = SAMPLE_LINE.match(line)
        if match is None or line.startswith("#"):
            continue
        labels = {pair.split("=", 1)[0] for pair in (match.group(2) or "").split(",") if pair}
        names.setdefault(match.group(1), set()).update(labels)
    return names


@pytest.fixture(scope="module")
def exported(redis_server: RedisServer) -> Iterator[dict[str, set[str]]]:
    """Sample name -> its label names, from both live exporters after one of each call."""
    metrics = BufferMetrics()
    buf = SignalBuffer.from_url(redis_server.url, namespace="deploy-check", observer=metrics.observe, env={})
    try:
        metrics.track(buf)
        buf.record("p0", 0, 0, [(1, 100), (2, 100)])
        buf.register(CacheTask("p0", 0, 1, "r1", need_prefill_tokens=50, num_layers=2))
        buf.finish("p0", 0, 1, "r1")
        bridge_metrics = BridgeMetrics()
        tracked = Layer0Bridge(buf, "p1", 0, num_layers=2)
        bridge_metrics.track(tracked)
        metrics.render()  # a first scrape times the "stats" call, so its series exists too
        names = sample_labels(scrape(metrics))
        bridge = sample_labels(scrape(bridge_metrics))
        tracked.close()  # its writer renews the identity's lease until then
    finally:
        buf.close()
    assert "rls_bridge_degraded" in bridge and not set(bridge) & set(names)
    yield {**names, **bridge}


def test_deploy_has_a_dashboard_and_rules_with_queries() -> None:
    assert DASHBOARDS and RULE_FILES
    names = {n for _, q in all_queries() for n in METRIC_NAME.findall(q)}
    # The panels the operations page describes: rates, latency, drops by reason, degraded time.
    for expected in (
        "rls_recorded_total",
        "rls_delivered_total",
        "rls_buffered_total",
        "rls_registered_total",
        "rls_finished_total",
        "rls_recovered_total",
        "rls_dropped_total",
        "rls_expired_total",
        "rls_degraded_seconds_total",
        "rls_call_duration_seconds_bucket",
        "rls_up",
        "rls_bridge_degraded",
        "rls_bridge_local_calls_total",
        "rls_bridge_errors_total",
    ):
        assert expected in names, expected


def test_every_metric_a_dashboard_or_rule_names_is_exported(exported: dict[str, set[str]]) -> None:
    missing = [(f, n) for f, q in all_queries() for n in METRIC_NAME.findall(q) if n not in exported]
    assert missing == [], f"named but not exported: {missing}; exported: {sorted(exported)}"


def test_every_label_a_query_matches_or_groups_by_is_exported(exported: dict[str, set[str]]) -> None:
    rls_labels = set().union(*(labels for name, labels in exported.items() if name.startswith("rls_")))
    used: set[str] = set()
    for _, query in all_queries():
        used.update(LABEL_MATCHER.findall(query))
        for group in GROUPING.findall(query):
            used.update(label.strip() for label in group.split(",") if label.strip())
    assert {"namespace", "instance", "rank", "reason", "operation"} <= used
    assert used - rls_labels - BUILTIN_LABELS == set()


def test_dashboard_panels_use_the_datasource_variable_and_unique_ids() -> None:
    for path in DASHBOARDS:
        dashboard: dict[str, Any] = json.loads(path.read_text())
        variables = {v["name"] for v in dashboard["templating"]["list"]}
        assert {"datasource", "namespace", "instance", "rank"} <= variables
        ids = [panel["id"] for panel in dashboard["panels"]]
        assert len(ids) == len(set(ids))
        for panel in dashboard["panels"]:
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert panel["targets"] and panel["description"], panel["title"]
            for query in (t["expr"] for t in panel["targets"]):
                used = set(re.findall(r"\$(\w+)", query)) - {"__rate_interval"}
                assert used <= variables, (panel["title"], used)


@pytest.mark.prometheus
def test_promtool_accepts_the_rules_and_the_prometheus_config() -> None:
    promtool = require_binary("promtool")
    for args in (
        ["check", "rules", *map(str, RULE_FILES)],
        ["check", "config", str(PROMETHEUS_CONFIG)],
        # The unit tests: each alert fires on the series that should wake an operator.
        ["test", "rules", *map(str, RULE_TESTS)],
    ):
        done = subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "SUCCESS" in done.stdout + done.stderr
    # The config loads every rule file of deploy/ (its rule_files glob is relative to it).
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    loaded = {p for pattern in config["rule_files"] for p in PROMETHEUS_CONFIG.parent.glob(pattern)}
    assert loaded == set(RULE_FILES)


def test_every_alert_has_a_unit_test_that_fires_it() -> None:
    alerts = {rule["alert"] for path in RULE_FILES for group in yaml.safe_load(path.read_text())["groups"]
              for rule in group["rules"]}  # fmt: skip
    fired = {
        case["alertname"]
        for path in RULE_TESTS
        for test in yaml.safe_load(path.read_text())["tests"]
        for case in test.get("alert_rule_test", [])
        if case.get("exp_alerts")
    }
    # RlsExporterMissing (absent(rls_up)) and RlsSlowCalls are checked quiet or by promtool alone.
    assert alerts - fired <= {"RlsExporterMissing", "RlsSlowCalls"}
    assert {
        "RlsSignalsExpiring",
        "RlsDropsOverNeed",
        "RlsBridgeDegraded",
        "RlsBridgeRanDegraded",
        "RlsBridgeErrors",
        "RlsIdentityRefused",
        "RlsOwnershipFenced",
        "RlsExporterCannotReachRedis",
        "RlsServerMayEvict",
        "RlsServerEvictedKeys",
        "RlsCountersMismatch",
        "RlsGroupCannotAgree",
        "RlsGroupRankRestarted",
        "RlsGroupSequencerTakenOver",
        "RlsGroupEntriesDropped",
        "RlsGroupSlowRelease",
    } <= fired
