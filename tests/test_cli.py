"""The `rls` operator commands on a real Redis the tests seed themselves, and their error paths:
one line on stderr, a non-zero exit, never a traceback."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer

from redis_layer_signals import CacheTask, SignalBuffer
from redis_layer_signals.cli import app
from redis_layer_signals.cli_help import describe, help_line
from redis_layer_signals.extras import install_hint
from tests.servers import RedisServer, free_port, library_functions, rls, running

TIMEOUT_S = 60
INTERNAL_PREFIX = re.compile(r"^[\w.]+: ")
"""An exception class or an operation name before the message (``BufferUnavailable: time: ...``)."""
TYPE_TAG = re.compile(r"<(bool|int|integer|float|str|text|path|uuid|datetime)>|range>|\[x?[<>]=|\bx>=")
"""typer's type tags (``--json <bool>``, ``--layers <int range> [x>=1]``): the help names values."""


@pytest.fixture
def seeded(redis_server: RedisServer, namespace: str) -> SignalBuffer:
    """p0/0: slot 5 holds req-live, slot 7 has two early signals; p1/3: one early signal."""
    buf = SignalBuffer.from_url(redis_server.url, namespace=namespace, env={})
    buf.register(CacheTask("p0", 0, 5, "req-live", need_prefill_tokens=4096, num_layers=61))
    buf.record("p0", 0, 0, [(7, 2048)])
    buf.record("p0", 0, 1, [(7, 1024, "req-early")])
    buf.record("p1", 3, 0, [(2, 512)])
    return buf


def test_inspect_json_lists_live_tasks_and_pending_signals_with_ages_and_ttls(
    redis_server: RedisServer, namespace: str, seeded: SignalBuffer
) -> None:
    done = rls("inspect", "--redis", redis_server.url, "--namespace", namespace, "--json")
    assert done.returncode == 0, done.stderr
    shot = json.loads(done.stdout)
    assert [
        (t["instance"], t["rank"], t["slot"], t["request_id"], t["need_prefill_tokens"]) for t in shot["tasks"]
    ] == [("p0", 0, 5, "req-live", 4096)]
    assert 0 < shot["tasks"][0]["lease_left_ms"] <= 900_000
    pending = [(p["instance"], p["rank"], p["slot"], p["layer"], p["tokens"], p["request_id"]) for p in shot["pending"]]
    assert pending == [("p0", 0, 7, 0, 2048, None), ("p0", 0, 7, 1, 1024, "req-early"), ("p1", 3, 2, 0, 512, None)]
    for p in shot["pending"]:
        assert p["age_ms"] >= 0 and 0 < p["ttl_ms"] <= 60_000
        assert p["age_ms"] + p["ttl_ms"] == pytest.approx(60_000, abs=2)


def test_inspect_filters_by_instance_rank_and_slot(
    redis_server: RedisServer, namespace: str, seeded: SignalBuffer
) -> None:
    base = ("inspect", "--redis", redis_server.url, "--namespace", namespace, "--json")
    only_p1 = json.loads(rls(*base, "--instance", "p1").stdout)
    assert only_p1["tasks"] == [] and [p["slot"] for p in only_p1["pending"]] == [2]
    slot5 = json.loads(rls(*base, "--instance", "p0", "--rank", "0", "--slot", "5").stdout)
    assert [t["request_id"] for t in slot5["tasks"]] == ["req-live"] and slot5["pending"] == []
    nothing = json.loads(rls(*base, "--rank", "9").stdout)
    assert nothing["tasks"] == [] and nothing["pending"] == []


def test_inspect_table_shows_the_request_and_counts(
    redis_server: RedisServer, namespace: str, seeded: SignalBuffer
) -> None:
    done = rls("inspect", "--redis", redis_server.url, "--namespace", namespace)
    assert done.returncode == 0, done.stderr
    assert "live tasks" in done.stdout and "(1)" in done.stdout
    assert "pending early signals" in done.stdout and "(3)" in done.stdout
    assert "req-live" in done.stdout and "req-early" in done.stdout


def test_stats_prints_the_namespace_counters(redis_server: RedisServer, namespace: str, seeded: SignalBuffer) -> None:
    done = rls("stats", "--redis", redis_server.url, "--namespace", namespace, "--json")
    assert done.returncode == 0, done.stderr
    counters = json.loads(done.stdout)
    assert counters["buffered"] == 3 and counters["registered"] == 1 and counters["delivered"] == 0
    assert counters == seeded.stats()
    table = rls("stats", "--redis", redis_server.url, "--namespace", namespace)
    assert "buffered" in table.stdout and "registered" in table.stdout


def test_stats_watch_refreshes_the_given_number_of_times(
    redis_server: RedisServer, namespace: str, seeded: SignalBuffer
) -> None:
    done = rls(
        "stats", "--redis", redis_server.url, "--namespace", namespace, "--watch", "--count", "2", "--interval", "0.1"
    )
    assert done.returncode == 0, done.stderr
    assert "registered" in done.stdout


def test_env_variables_stand_in_for_redis_and_namespace(
    redis_server: RedisServer, namespace: str, seeded: SignalBuffer
) -> None:
    done = rls("stats", "--json", env={"RLS_REDIS_URL": redis_server.url, "RLS_NAMESPACE": namespace})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["buffered"] == 3


def command_calls(client: Any) -> dict[str, int]:
    """Calls per command since the server started (INFO commandstats)."""
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in client.info("commandstats").items()}


def test_purge_refuses_without_yes_and_removes_only_its_namespace(redis_server: RedisServer, namespace: str) -> None:
    keep, gone = f"{namespace}-keep", f"{namespace}-go"
    for ns in (keep, gone):
        buf = SignalBuffer.from_url(redis_server.url, namespace=ns, env={})
        buf.record("p0", 0, 0, [(1, 10)])
        buf.register(CacheTask("p0", 1, 2, "r", need_prefill_tokens=10, num_layers=2))
        buf.close()
    client = redis_server.client()
    client.set(f"unrelated:{namespace}", "1")

    def keys_of(ns: str) -> list[bytes]:
        return list(client.scan_iter(match=f"rls:{{{ns}/*", count=1000))

    before = len(keys_of(gone))
    # Reply keys live seconds only and may expire while the commands run on a loaded machine:
    # the keys that must survive the purge of the other namespace are those that outlive it.
    lasting = {key for key in keys_of(keep) if client.pttl(key) == -1 or client.pttl(key) > 60_000}
    refused = rls("purge", "--redis", redis_server.url, "--namespace", gone)
    assert refused.returncode != 0 and "without --yes" in refused.stderr
    assert len(keys_of(gone)) == before > 0

    calls_before = command_calls(client)
    done = rls("purge", "--redis", redis_server.url, "--namespace", gone, "--yes")
    assert done.returncode == 0, done.stderr
    calls = {name: n - calls_before.get(name, 0) for name, n in command_calls(client).items()}
    assert calls.get("scan", 0) > 0
    assert not {"keys", "flushdb", "flushall"} & {name for name, n in calls.items() if n > 0}
    assert f"purged {before} keys" in done.stdout
    assert keys_of(gone) == []
    assert lasting and lasting <= set(keys_of(keep))  # a namespace that shares the prefix is untouched
    assert client.get(f"unrelated:{namespace}") == b"1"


@pytest.mark.parametrize(
    "args",
    [
        ("stats",),
        ("inspect",),
        ("purge", "--namespace", "x", "--yes"),
        ("simulate", "--requests", "1", "--layers", "1"),
    ],
)
def test_unreachable_redis_prints_one_line_and_exits_non_zero(args: tuple[str, ...]) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    done = rls(*args, "--redis", url)
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("rls: error:"), done.stderr
    # What to fix, not which internal step gave up: no "BufferUnavailable:" nor "time:" first.
    message = lines[0].removeprefix("rls: error: ")
    assert INTERNAL_PREFIX.match(message) is None, message
    assert message.startswith("Redis unavailable") and "Connection refused" in message, message


def test_metrics_keeps_serving_while_redis_is_unreachable() -> None:
    """The exporter outlives Redis: it says so in one line and serves rls_up 0 (tests/test_metrics.py)."""
    done = rls("metrics", "--port", "0", "--duration-s", "1", "--redis", f"redis://127.0.0.1:{free_port()}/0")
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert "serving rls_up 0 until it does" in done.stderr


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (("stats", "--redis", "localhost:6379"), "url"),
        (("stats", "--redis", "gopher://x"), "gopher"),
        (("stats", "--redis", "memory://", "--namespace", "bad name!"), "namespace"),
        (("simulate", "--layers", "0"), "--layers"),
        (("simulate", "--early-share", "2"), "--early-share"),
        (("inspect", "--nope"), "--nope"),
        (("purge",), "--namespace"),
        (("node", "--instance", "p0"), "memory://"),
        (("registrar",), "memory://"),
        (("simulate", "--namespace", "a{b}"), "namespace"),
    ],
)
def test_bad_arguments_print_one_line_naming_the_problem(args: tuple[str, ...], named: str) -> None:
    done = rls(*args)
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and named in lines[0] and "Traceback" not in done.stderr, done.stderr


def test_simulate_cli_writes_json_with_snake_case_figures(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    done = rls("simulate", "--requests", "4", "--layers", "4", "--ranks", "1", "--seed", "3", "--json", str(out))
    assert done.returncode == 0, done.stderr
    figures = json.loads(out.read_text())
    for key in (
        "requests",
        "signals",
        "lost",
        "hung",
        "delivered",
        "buffered_early",
        "recovered",
        "dropped",
        "superseded",
        "record_p50_ms",
        "record_p99_ms",
        "register_p50_ms",
        "register_p99_ms",
    ):
        assert key in figures, key
    assert figures["requests"] == 8 and figures["lost"] == figures["hung"] == 0 and figures["ok"] is True
    assert "every layer of every chunk sent exactly once" in done.stdout


def test_simulate_cli_drop_baseline_lists_violations_and_fails(tmp_path: Path) -> None:
    out = tmp_path / "drop.json"
    done = rls(
        "simulate",
        "--mode",
        "drop",
        "--requests",
        "6",
        "--layers",
        "3",
        "--early-share",
        "0.5",
        "--hang-timeout-s",
        "0.3",
        "--json",
        str(out),
    )
    assert done.returncode == 1
    assert "FAILED" in done.stderr and "never sent" in done.stderr
    figures = json.loads(out.read_text())
    assert figures["hung"] > 0 and figures["ok"] is False


def test_module_and_help_list_every_command() -> None:
    done = rls("--help")
    assert done.returncode == 0
    for command in ("simulate", "inspect", "stats", "purge", "metrics", "node", "registrar"):
        assert command in done.stdout


def test_simulate_chaos_that_injected_no_fault_says_so_and_fails() -> None:
    """A chaos run whose faults never landed has proven nothing: one request per rank ends the
    run before its fault window opens."""
    done = rls("simulate", "--chaos", "--requests", "1", "--ranks", "1", "--instances", "1", "--layers", "2")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "0 faults" in done.stdout and "no fault was injected" in done.stderr


def test_simulate_chaos_outage_reports_figures_and_passes(tmp_path: Path) -> None:
    """``--chaos-outage``: the FastDeploy reference messager through a Redis outage, with its
    figures on stdout and in the JSON."""
    out = tmp_path / "outage.json"
    args = ("--chaos-outage", "aof", "--requests", "12", "--layers", "2", "--chaos-retry-s", "0.3")
    done = rls("simulate", *args, "--chaos-down-s", "1.2", "--json", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    figures = json.loads(out.read_text())
    assert figures["finished"] == figures["acknowledged"] == figures["requests"] == 12
    assert figures["block_writes"] == figures["expected_block_writes"] > 0
    assert figures["calls_served_locally"] > 0 and figures["entries_written_back"] > 0
    assert figures["down_s"] >= 1.2 and figures["problems"] == []
    assert "every signal counted once" in done.stdout


OPERATOR_COMMANDS = [
    ("inspect",),
    ("stats",),
    ("stats", "--watch", "--count", "1"),
    ("purge", "--namespace", "x", "--yes"),
    ("metrics", "--port", "0", "--duration-s", "1"),
    ("library", "load"),
    ("library", "status"),
]


@pytest.mark.parametrize("args", OPERATOR_COMMANDS, ids=lambda a: " ".join(a))
def test_operator_commands_without_a_server_name_redis_and_exit_2(args: tuple[str, ...]) -> None:
    """No default memory:// for them: its fresh, empty server looked like a healthy idle namespace."""
    done = rls(*args)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--redis" in lines[0] and "RLS_REDIS_URL" in lines[0], done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""


@pytest.mark.parametrize(
    "args", [("inspect",), ("inspect", "--json"), ("stats",), ("stats", "--json"), ("purge",), ("purge", "--yes")]
)
def test_a_namespace_without_keys_is_reported_and_exits_3(namespace: str, args: tuple[str, ...]) -> None:
    writes = ("fcall", "del", "unlink", "hset", "set", "pexpire", "expire", "flushdb", "flushall")
    # A server of its own: on the shared one, another test's bridge (its writer renews a lease)
    # may write meanwhile, and what matters is that this command wrote nothing.
    with running() as redis_server, redis_server.client() as client:
        before = command_calls(client)
        done = rls(*args, "--redis", redis_server.url, "--namespace", f"{namespace}-misspelt")
        assert done.returncode == 3, done.stdout + done.stderr
        assert f"'{namespace}-misspelt' has no keys" in done.stderr
        after = command_calls(client)
        assert done.stdout == ""
        assert {name: after.get(name, 0) - before.get(name, 0) for name in writes} == dict.fromkeys(writes, 0)


def test_stats_watch_on_a_namespace_without_keys_says_so_and_watches(redis_server: RedisServer, namespace: str) -> None:
    done = rls("stats", "--redis", redis_server.url, "--namespace", namespace, "--watch", "--count", "2")
    assert done.returncode == 0, done.stderr
    assert "has no keys on this server yet: watching" in done.stderr
    assert "registered" in done.stdout


def test_inspect_of_an_idle_namespace_with_counters_is_not_empty(redis_server: RedisServer, namespace: str) -> None:
    """A namespace whose requests all finished keeps its counters: idle, not missing."""
    with SignalBuffer.from_url(redis_server.url, namespace=namespace, env={}) as buf:
        buf.register(CacheTask("p0", 0, 5, "r", need_prefill_tokens=10, num_layers=1))
        buf.finish("p0", 0, 5, "r")
    done = rls("inspect", "--redis", redis_server.url, "--namespace", namespace, "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["tasks"] == []


OTHER_LIBRARY = "#!lua name=someone_elses\nredis.register_function('their_ping', function() return 'pong' end)"


@pytest.fixture
def foreign_server() -> Any:
    """A server the run did not start, holding another team's function library and a client."""
    server = RedisServer().start()
    with server.client() as client:
        client.function_load(OTHER_LIBRARY)
        yield server, client
    server.cleanup()


@pytest.mark.parametrize("how", ["--redis", "RLS_REDIS_URL"])
def test_chaos_on_a_server_the_run_did_not_start_refuses_without_yes_and_flushes_nothing(
    foreign_server: Any, how: str
) -> None:
    server, client = foreign_server
    client_id = client.client_id()
    args = ("simulate", "--chaos", "--requests", "4")
    done = rls(*args, "--redis", server.url) if how == "--redis" else rls(*args, env={"RLS_REDIS_URL": server.url})
    assert done.returncode == 1, done.stdout + done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    for named in ("refusing --chaos", server.url, "--yes", "FUNCTION FLUSH", "CLIENT KILL"):
        assert named in lines[0], (named, lines[0])
    assert library_functions(client, "someone_elses") == {"their_ping"}
    assert [entry[1] for entry in client.function_list()] == [b"someone_elses"]  # ours was not loaded either
    assert client.client_id() == client_id  # the same connection: nobody killed it
    assert client.dbsize() == 0


def test_chaos_with_yes_runs_on_a_server_the_run_did_not_start(foreign_server: Any) -> None:
    """Past the refusal: one request per rank ends before the fault window, which the run says."""
    server, _client = foreign_server
    args = ("--requests", "1", "--ranks", "1", "--instances", "1", "--layers", "2")
    done = rls("simulate", "--chaos", "--yes", *args, "--redis", server.url)
    assert "refusing" not in done.stderr
    assert f"chaos on {server.url}: 0 faults" in done.stdout, done.stdout + done.stderr
    assert done.returncode == 1 and "no fault was injected" in done.stderr


def test_bench_without_matplotlib_says_which_extra_before_it_starts(tmp_path: Path) -> None:
    code = "import sys; sys.modules['matplotlib'] = None; from redis_layer_signals.cli import main; main(sys.argv[1:])"
    done = subprocess.run(
        [sys.executable, "-c", code, "bench", "--iterations", "1", "--duration", "0.1"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if not k.startswith("RLS_")},
    )
    assert done.returncode == 1
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and install_hint("bench") in lines[0], done.stderr
    assert "pip install 'redis-layer-signals[" not in done.stderr  # not on any index yet
    assert "Traceback" not in done.stderr and list(tmp_path.iterdir()) == []  # nothing started, nothing written


def test_bench_writes_to_a_new_folder_it_names_never_the_committed_results() -> None:
    from redis_layer_signals.bench import runner

    assert runner.parser().parse_args([]).out is None
    out = runner.default_out()
    assert out.name.startswith("rls-bench-") and not out.exists()
    assert "benchmarks" not in out.parts


def test_chaos_refusal_does_not_print_the_password() -> None:
    done = rls("simulate", "--chaos", "--redis", f"redis://ops:s3cret@127.0.0.1:{free_port()}/0")
    assert done.returncode == 1 and "refusing --chaos on redis://ops:***@127.0.0.1:" in done.stderr, done.stderr
    assert "s3cret" not in done.stderr


# -- help ------------------------------------------------------------------------------------


def every_command() -> list[tuple[str, Any, Any]]:
    """(path, command, context) of ``rls``, its groups and every command under them."""
    root: Any = typer.main.get_command(app)
    found = [("rls", root, root.context_class(root, info_name="rls", max_content_width=200, terminal_width=200))]
    for path, group, context in found:  # grows while it is walked: groups add their commands
        for name in getattr(group, "list_commands", lambda _: [])(context):
            command = group.get_command(context, name)
            sub = command.context_class(command, info_name=name, parent=context)
            found.append((f"{path} {name}", command, sub))
    return found


def options_of(command: Any, context: Any) -> list[Any]:
    return [p for p in command.get_params(context) if p.param_type_name == "option" and not p.hidden]


def squashed(text: str) -> str:
    """``text`` without whitespace: a description wrapped over lines (or at a hyphen) still matches."""
    return "".join(text.split())


@pytest.mark.parametrize(("path", "command", "context"), every_command(), ids=lambda v: v if isinstance(v, str) else "")
def test_help_of_every_command_describes_every_option_with_no_type_tags(path: str, command: Any, context: Any) -> None:
    text = command.get_help(context)
    assert TYPE_TAG.search(text) is None, f"{path}: {TYPE_TAG.search(text)}"
    for option in options_of(command, context):
        assert (option.help or "").strip(), f"{path} {option.opts[0]} has no description"
        assert squashed(help_line(option)) in squashed(text), f"{path} {option.opts[0]}"
    assert "Options:" in text and "--help" in text


def option_rows(text: str) -> dict[str, str]:
    """Each option's row of a help text, its wrapped lines joined: ``{"--batch": "--batch <n> ..."}``."""
    rows: dict[str, str] = {}
    last = ""
    for line in text.splitlines():
        if line.startswith("  --"):
            last = line.split()[0]
            rows[last] = " ".join(line.split())
        elif last and line.startswith("   "):
            rows[last] += " " + " ".join(line.split())
        else:
            last = ""
    return rows


def test_help_names_each_value_and_says_its_range_after_the_description() -> None:
    done = rls("simulate", "--help")
    assert done.returncode == 0, done.stderr
    rows = option_rows(done.stdout)
    assert rows["--batch"] == "--batch <n> Engine slots per rank (1-512; default: 8)."
    assert rows["--layers"] == "--layers <n> Layers per request (default: 61)."  # a lower bound alone: unsaid
    assert rows["--seed"].startswith("--seed <n> Seed of the random workload")  # undescribed once
    assert rows["--redis"].startswith("--redis <url> ") and "env: RLS_REDIS_URL" in rows["--redis"]
    assert rows["--json"] == "--json <file> Also write the figures as JSON to this file."
    assert rows["--yes"].startswith("--yes Let --chaos")  # a flag takes no value
    assert rows["--chaos"] == "--chaos Restart or fail over the Redis mid-run."  # a lone flag has no default
    assert TYPE_TAG.search(done.stdout) is None


def test_help_summaries_wrap_to_the_terminal_not_to_the_docstring() -> None:
    """`rls stats`' docstring breaks its second paragraph after "which --watch only": the help re-wraps it."""
    wide = {path: command.get_help(context) for path, command, context in every_command()}
    lines = [line.strip() for line in wide["rls stats"].splitlines()]
    assert lines[2] == "The namespace's counters, summed over its ranks."
    assert lines[4].startswith("Expired signals are swept first.") and lines[4].endswith(
        "which --watch only warns about."
    )
    narrow = rls("stats", "--help", env={"COLUMNS": "60"})
    assert narrow.returncode == 0, narrow.stderr
    assert max(len(line) for line in narrow.stdout.splitlines()) <= 60
    assert "the namespace has no keys" in " ".join(narrow.stdout.split())


def test_describe_puts_the_range_inside_the_sentence() -> None:
    root: Any = typer.main.get_command(app)
    context = root.context_class(root, info_name="rls")
    simulate = root.get_command(context, "simulate")
    by_name = {p.opts[0]: p for p in options_of(simulate, context)}
    assert describe(by_name["--batch"]) == "Engine slots per rank (1-512)."
    assert describe(by_name["--early-share"]) == "Tasks late for layer 0 (0-1)."
    assert describe(by_name["--layers"]) == "Layers per request (at least 1)."  # the docs say every range
    assert describe(by_name["--json"]) == "Also write the figures as JSON to this file."


NARROW = 80
"""The terminal width the help is judged at: the one every terminal opens with."""
SUMMARY_LINES = 2
"""Lines a command's summary may take in its group's list, as pip's and redis-cli's do."""
DESCRIPTION_LINES = 6
"""Lines a command's own help may take before its options."""
SIMULATE_LINES = 40


def narrow_help(path: str) -> str:
    """``rls ... --help`` of the command at ``path``, rendered at ``NARROW`` columns."""
    root: Any = typer.main.get_command(app)
    command, context = root, root.context_class(root, info_name="rls", max_content_width=NARROW, terminal_width=NARROW)
    for name in path.split()[1:]:
        command = command.get_command(context, name)
        context = command.context_class(command, info_name=name, parent=context)
    return str(command.get_help(context))


def command_rows(text: str) -> dict[str, int]:
    """The lines each command's summary takes in a group's help: ``{"patch": 1}``."""
    rows: dict[str, int] = {}
    section, last = "", ""
    for line in text.splitlines():
        if line and not line.startswith(" "):
            section = line
        elif section == "Commands:" and line.startswith("  ") and not line.startswith("   "):
            last = line.split()[0]
            rows[last] = 1
        elif section == "Commands:" and line.startswith("   ") and last:
            rows[last] += 1
    return rows


@pytest.mark.parametrize(("path", "command", "context"), every_command(), ids=lambda v: v if isinstance(v, str) else "")
def test_help_is_short_and_describes_every_parameter(path: str, command: Any, context: Any) -> None:
    """`rls fastdeploy --help` gave `patch` a 12-line summary; `rls simulate --help` ran to 75 lines."""
    for param in command.get_params(context):
        if not getattr(param, "hidden", False):
            assert (getattr(param, "help", None) or "").strip(), f"{path} {param.name} has no description"
    text = narrow_help(path)
    assert max(len(line) for line in text.splitlines()) <= NARROW, text
    description = text.split("\n\n", 1)[1].split("\n\n", 1)[0] if "\n\n" in text else ""
    assert len(description.splitlines()) <= DESCRIPTION_LINES, f"{path}:\n{text}"
    for name, lines in command_rows(text).items():
        assert lines <= SUMMARY_LINES, f"{path}: the summary of {name} takes {lines} lines:\n{text}"


def test_simulate_help_fits_a_screen() -> None:
    text = narrow_help("rls simulate")
    assert len(text.splitlines()) <= SIMULATE_LINES, text
    assert "--chaos-outage" in text and "--tp" in text  # every option still listed


def test_rls_without_a_command_prints_the_help_and_exits_2() -> None:
    done = rls()
    assert done.returncode == 2
    assert done.stdout.startswith("Usage: rls [OPTIONS] COMMAND") and "Commands:" in done.stdout
    assert done.stderr == ""
