"""`make check` runs the suite without the tests that need root or Debian's prometheus package,
chosen by marker, and says so; `make test` (what CI runs) deselects nothing. A new test that
makes network namespaces or runs promtool without its marker fails here, not in a contributor's
`make check`."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
NETNS_IMPORTS = ("tests.netns", "tests.hosted", "redis_layer_signals.simulate.hosts")
PROMETHEUS_BINARIES = ("promtool", "prometheus")
NEEDS_NO_HOSTS = {"tests/test_partition_chaos.py::test_simulate_chaos_partition_needs_the_runs_own_redis"}
"""Tests in a module that imports the hosts which make no host: the refusal comes first."""


def makefile() -> str:
    return (ROOT / "Makefile").read_text().replace("\\\n", " ")


def recipe(target: str) -> list[str]:
    """The recipe lines of ``target`` (tab-indented, up to the next blank line)."""
    text = makefile()
    match = re.search(rf"^{re.escape(target)}:[^\n]*\n((?:\t[^\n]*\n)*)", text, re.MULTILINE)
    assert match is not None, target
    return [line.strip() for line in match.group(1).splitlines()]


def imported(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def needing_root_or_prometheus() -> tuple[set[str], set[str]]:
    """Test ids (file::function) that make network namespaces (every test of a module that
    imports the hosts, but those of ``NEEDS_NO_HOSTS``) and those that start promtool or prometheus."""
    netns: set[str] = set()
    prometheus: set[str] = set()
    for path in sorted(TESTS.glob("test_*.py")):
        text = path.read_text()
        tree = ast.parse(text)
        uses_hosts = bool(imported(tree) & set(NETNS_IMPORTS))
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or not node.name.startswith("test_"):
                continue
            source = ast.get_source_segment(text, node) or ""
            test_id = f"tests/{path.name}::{node.name}"
            if uses_hosts and test_id not in NEEDS_NO_HOSTS:
                netns.add(test_id)
            if any(f'require_binary("{binary}")' in source for binary in PROMETHEUS_BINARIES):
                prometheus.add(test_id)
    return netns, prometheus


def collected(files: list[str], marker_expression: str) -> set[str]:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            marker_expression,
            *files,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return {line.split("[", 1)[0] for line in done.stdout.splitlines() if "::" in line}


def test_make_check_deselects_exactly_the_tests_that_need_root_or_prometheus() -> None:
    netns, prometheus = needing_root_or_prometheus()
    assert (
        "tests/test_partition_finish.py::test_finish_lost_to_a_partition_no_longer_lets_the_next_request_reach_the_finished_task"
        in netns
    )
    assert "tests/test_deploy.py::test_promtool_accepts_the_rules_and_the_prometheus_config" in prometheus
    files = sorted({test_id.split("::")[0] for test_id in netns | prometheus})
    marker_expression = re.search(r"^CHECK_MARKERS := (.*)$", makefile(), re.MULTILINE)
    assert marker_expression is not None
    kept = collected(files, marker_expression.group(1))
    assert kept & (netns | prometheus) == set()
    # what the markers leave to make check in those files: the tests that need neither
    assert NEEDS_NO_HOSTS.issubset(kept)
    assert "tests/test_deploy.py::test_dashboard_panels_use_the_datasource_variable_and_unique_ids" in kept


def test_make_check_names_what_it_left_out_and_make_test_deselects_nothing() -> None:
    check = recipe("check")
    assert check[0] == '$(BIN)/pytest -m "$(CHECK_MARKERS)" $(CHECK_TESTS)'
    said = " ".join(check[1:])
    for left_out in ("netns", "prometheus", "engine", "$(OTHER_PYTHONS)", "Valkey 8.1", "make servers"):
        assert left_out in said, left_out
    for line in recipe("pytest") + recipe("pytest-%"):
        assert not re.search(r"\s(-m|-k)\s", f" {line} "), line
    addopts = re.search(r'^addopts = "(.*)"$', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert addopts is not None and not re.search(r"(^|\s)(-m|-k)\s", addopts.group(1))
    test_rule = re.search(r"^test: (.*)$", makefile(), re.MULTILINE)
    assert test_rule is not None and "check" not in test_rule.group(1).split()
    assert "make test" in (ROOT / ".ci" / "run").read_text()
