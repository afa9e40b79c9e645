"""Smoke test of the benchmark at tiny sizes: the output has its structure and every ratio is
computed from the numbers measured in the same run. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis

from redis_layer_signals.bench import BenchConfig, names, run
from redis_layer_signals.bench.baselines import Floor, FloorDirect
from redis_layer_signals.bench.commandstats import EVALSHA
from redis_layer_signals.bench.report import TARGETS, check, markdown, target_value
from redis_layer_signals.bench.runner import write
from tests.servers import RedisServer

IMPLS = {"ours", "floor", "floor_direct", "naive", "dict"}


@pytest.fixture(scope="module")
def result(redis_server: RedisServer) -> dict[str, Any]:
    config = BenchConfig(
        redis_url=redis_server.url,
        sizes=(1, 3),
        pending=(0, 2),
        layers=(1, 3),
        layer_sizes=(3,),
        iterations=6,
        warmup=1,
        processes=2,
        duration_s=0.2,
        contention_batches=(2,),
        rounds=1,
        redis_benchmark_requests=200,
        memory_slots=8,
    )
    return run(config)


def _case(result: dict[str, Any], **match: Any) -> dict[str, Any]:
    found = [c for c in result["latency"] if all(c[k] == v for k, v in match.items())]
    assert len(found) == 1, match
    return found[0]


def test_every_case_is_measured_for_every_implementation(result: dict[str, Any]) -> None:
    for path in ("buffered", "delivered"):
        for size in (1, 3):
            assert {
                c["impl"]
                for c in result["latency"]
                if c["mode"] == "sync" and c["op"] == "record" and c["path"] == path and c["size"] == size
            } == IMPLS
            assert {
                c["impl"]
                for c in result["latency"]
                if c["mode"] == "async" and c["op"] == "record" and c["path"] == path and c["size"] == size
            } == {"ours", "floor"}
    for pending in ("0", "2"):
        assert {
            c["impl"]
            for c in result["latency"]
            if c["op"] == "register" and c["mode"] == "sync" and c["path"] == pending
        } == IMPLS
    assert {c["impl"] for c in result["latency"] if c["op"] == "finish" and c["mode"] == "sync"} == IMPLS
    assert {c["impl"] for c in result["latency"] if c["op"] == "finish" and c["mode"] == "async"} == {"ours", "floor"}
    for case in result["latency"]:
        assert case["calls"] > 0 and 0 < case["p50_us"] <= case["p99_us"], case
        assert case["throughput"] > 0


def test_ratios_are_computed_from_the_measured_medians(result: dict[str, Any]) -> None:
    ours = _case(result, mode="sync", op="record", path="delivered", size=3, impl="ours")
    floor = _case(result, mode="sync", op="record", path="delivered", size=3, impl="floor")
    naive = _case(result, mode="sync", op="record", path="delivered", size=3, impl="naive")
    assert result["ratios"]["record.delivered.3.ours/floor"] == pytest.approx(ours["p50_us"] / floor["p50_us"])
    assert result["ratios"]["record.delivered.3.ours/naive"] == pytest.approx(ours["p50_us"] / naive["p50_us"])
    register = _case(result, mode="sync", op="register", path="2", impl="ours")
    register_floor = _case(result, mode="sync", op="register", path="2", impl="floor")
    assert result["ratios"]["register.2.ours/floor"] == pytest.approx(register["p50_us"] / register_floor["p50_us"])


def test_ratios_against_the_direct_floor_are_computed_from_the_measured_percentiles(result: dict[str, Any]) -> None:
    values = result["ratios"]
    for name, match in (
        ("record.buffered.1", {"op": "record", "path": "buffered", "size": 1}),
        ("record.delivered.3", {"op": "record", "path": "delivered", "size": 3}),
        ("register.2", {"op": "register", "path": "2"}),
        ("finish", {"op": "finish"}),
    ):
        ours = _case(result, mode="sync", impl="ours", **match)
        direct = _case(result, mode="sync", impl="floor_direct", **match)
        assert values[f"{name}.ours/floor_direct"] == pytest.approx(ours["p50_us"] / direct["p50_us"])
        assert values[f"{name}.ours/floor_direct.p99"] == pytest.approx(ours["p99_us"] / direct["p99_us"])
    assert not [name for name in values if name.startswith("async.") and "floor_direct" in name]


def test_the_direct_floor_has_its_own_table_and_keeps_the_targets(result: dict[str, Any]) -> None:
    assert [row["name"] for row in result["targets"]] == [name for name, _, _ in TARGETS]
    targets = [name for name, _, _ in TARGETS if name.endswith("ours/floor")]
    assert [row["target"] for row in result["reference"]] == targets
    text = markdown(result)
    heading = "## Against the floor sent the same way (reference, not a target)"
    assert text.index("## Targets") < text.index(heading) < text.index("## Latency")
    section = text[text.index(heading) : text.index("## Latency")]
    assert result["ratios"]["contention.ours/floor_direct"] > 0
    for row in result["reference"]:
        assert row["name"] == row["target"] + "_direct"
        assert row["value"] == result["ratios"].get(row["name"])
        assert row["floor"] == result["ratios"].get(row["target"])
        shown = ["-" if value is None else f"{value:,.2f}" for value in (row["value"], row["floor"])]
        assert f"| {row['target'].removesuffix('.ours/floor')} | {shown[0]} | {shown[1]} |" in section
    # The latency table's ours/impl column covers the new rows too.
    ours = _case(result, mode="sync", op="finish", impl="ours")
    direct = _case(result, mode="sync", op="finish", impl="floor_direct")
    row = next(line for line in text.splitlines() if line.startswith("| sync | finish | - | 0 | floor_direct |"))
    assert row.endswith(f"| {ours['p50_us'] / direct['p50_us']:,.2f} |")


def _evalsha_calls(client: redis.Redis) -> int:
    return int(client.info("commandstats").get(EVALSHA, {}).get("calls", 0))


def test_the_direct_floor_runs_the_no_op_script_without_redis_py_s_command_path(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = redis_server.client()
    floor = FloorDirect(client, names.floor_key())
    try:
        assert floor.sha == Floor(client, names.floor_key()).sha
        before = _evalsha_calls(client)

        def refuse(*args: object, **options: object) -> object:
            raise AssertionError("the direct floor went through execute_command")

        with monkeypatch.context() as patched:
            patched.setattr(client, "execute_command", refuse)
            replies = [floor.call(Floor.flat([(slot, 2048 + slot) for slot in range(4)])) for _ in range(5)]
        after = _evalsha_calls(client)
    finally:
        floor.close()
        client.close()
    assert replies == [1] * 5
    assert after - before == 5


def test_the_direct_floor_refuses_a_client_the_buffer_would_not_send_directly(redis_server: RedisServer) -> None:
    client = redis.Redis.from_url(redis_server.url, protocol=3)
    try:
        with pytest.raises(TypeError):
            FloorDirect(client, names.floor_key())
    finally:
        client.close()


def test_contention_throughput_ratios_come_from_the_worker_counts(result: dict[str, Any]) -> None:
    rows = {row["impl"]: row for row in result["contention"]}
    assert set(rows) == {"ours", "naive", "floor", "floor_direct"}
    for row in rows.values():
        assert row["processes"] == 2 and row["calls"] > 0
        assert row["throughput"] == pytest.approx(row["calls"] * row["batch"] / row["elapsed_s"])
    for other in ("naive", "floor", "floor_direct"):
        assert result["ratios"][f"contention.ours/{other}"] == pytest.approx(
            rows["ours"]["throughput"] / rows[other]["throughput"]
        )


def test_server_cost_and_memory_are_reported(result: dict[str, Any]) -> None:
    assert [row["entries"] for row in result["scaling"]["record_per_entry"]] == [1, 3]
    assert all(row["server_us_per_call"] > 0 for row in result["scaling"]["record_per_entry"])
    assert [row["pending_layers"] for row in result["scaling"]["register_vs_pending"]] == [0, 2]
    pending = result["memory"]["pending"]
    assert [(row["slots"], row["layers"]) for row in pending] == [(8, 1), (8, 61)]
    assert all(row["per_signal"] == pytest.approx(row["bytes"] / row["signals"]) for row in pending)
    assert result["ratios"]["memory.bytes_per_pending_signal"] == max(row["per_signal"] for row in pending)
    assert {row["command"] for row in result["redis_benchmark"]} >= {"PING", "SET"}
    assert result["machine"]["redis_version"].startswith(("6.", "7.", "8."))


def test_record_onto_pending_layers_is_measured_against_both_floors(result: dict[str, Any]) -> None:
    layered = result["pending_layers"]
    assert {(c["size"], c["path"], c["impl"]) for c in layered} == {
        (3, layers, impl) for layers in ("1", "3") for impl in ("ours", "floor", "floor_direct")
    }
    ours = {c["path"]: c for c in layered if c["impl"] == "ours"}
    floor = {c["path"]: c for c in layered if c["impl"] == "floor"}
    assert result["ratios"]["pending.record.3.3/1"] == pytest.approx(ours["3"]["p50_us"] / ours["1"]["p50_us"])
    expected = ours["3"]["p50_us"] / floor["3"]["p50_us"]
    assert result["ratios"]["pending.record.3.3.ours/floor"] == pytest.approx(expected)
    assert "| 3 | 3 | ours |" in markdown(result)


def test_targets_follow_the_ratios(result: dict[str, Any]) -> None:
    assert [row["name"] for row in result["targets"]] == [name for name, _, _ in TARGETS]
    for row in result["targets"]:
        value = result["ratios"].get(row["name"])
        assert row["value"] == value
        if value is not None:
            assert row["met"] == (value <= row["limit"] if row["comparison"] == "<=" else value >= row["limit"])


def test_the_run_removes_every_key_it_wrote(result: dict[str, Any], redis_server: RedisServer) -> None:
    client = redis_server.client()
    left = [
        key
        for pattern in (f"rls:{{{names.NAMESPACE_PREFIX}*", f"{names.NAIVE_PREFIX}:{{{names.NAMESPACE_PREFIX}*")
        for key in client.scan_iter(match=pattern, count=1000)
    ]
    client.close()
    assert result["latency"] and left == []


def test_check_marks_a_missed_limit_and_an_unmeasured_one() -> None:
    rows = {row["name"]: row for row in check({"record.buffered.1.ours/floor": 1.31, "contention.ours/naive": 5.0})}
    assert rows["record.buffered.1.ours/floor"]["met"] is False
    assert rows["contention.ours/naive"]["met"] is True
    assert rows["finish.ours/floor"]["met"] is None


def test_written_outputs_are_json_markdown_and_png(result: dict[str, Any], tmp_path: Path) -> None:
    paths = write(result, tmp_path)
    written = json.loads(paths[0].read_text())
    assert written["ratios"] == result["ratios"] and "contention.ours/floor_direct" in written["ratios"]
    assert written["reference"] == result["reference"]
    assert {case["impl"] for case in written["latency"]} >= {"floor_direct"}
    text = paths[1].read_text()
    assert text == markdown(result) and "| target | measured | limit | met |" in text
    assert paths[2].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert paths[3].name == "latency_vs_pending.png" and paths[3].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_package_imports_without_matplotlib() -> None:
    code = "import sys, redis_layer_signals.bench; assert 'matplotlib' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_rls_bench_is_a_command_with_the_benchmark_options() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "redis_layer_signals", "bench", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    for option in ("--redis", "--server", "--sizes", "--pending", "--layers", "--layer-sizes", "--processes", "--json"):
        assert option in done.stdout, option


def test_instruction_counts_are_written_for_every_case_and_the_table_matches_the_json(tmp_path: Path) -> None:
    """benchmarks/instructions.py at a tiny size: every case is counted, both files are written,
    and the table prints the JSON's numbers. How ours compares with the floor or with the commands
    alone is not asserted: two counts taken in different windows pick up different shares of the
    server's timers and key expiry, so that comparison is the benchmark's report, not a test."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "instructions.py"
    names = ["record.delivered.1", "record.half.32", "register.1", "finish"]
    cases = ",".join(names)
    done = subprocess.run(
        [sys.executable, str(script), "--calls", "6", "--only", cases, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    rows = json.loads((tmp_path / "instructions.json").read_text())
    assert [row["case"] for row in rows] == names
    table = (tmp_path / "instructions.md").read_text()
    assert done.stdout == table.split("\n\n", 1)[1]
    lines = {line.split(" | ")[0].removeprefix("| "): line for line in table.splitlines() if line.startswith("| ")}
    for row in rows:
        assert row["calls"] >= 1
        for column in ("ours", "floor", "bare"):
            assert row[column] is not None and row[column] > 0, (row["case"], column)
        assert row["ratio"] == pytest.approx(row["ours"] / row["floor"])
        cells = [cell.strip() for cell in lines[row["case"]].strip("| ").split(" | ")]
        assert cells[1:4] == [f"{row[column]:,.0f}" for column in ("ours", "bare", "floor")], cells
        assert cells[4] == f"{row['ratio']:.2f}"
        assert cells[5] == f"{row['bare'] / row['ours']:.2f}"


def test_a_ratio_that_rounds_to_its_limit_shows_a_third_decimal() -> None:
    assert target_value(1.5047, 1.5) == "1.505"
    assert target_value(1.4951, 1.5) == "1.495"
    assert target_value(1.5, 1.5) == "1.50"
    assert target_value(1.4083, 1.3) == "1.41"
    assert target_value(106.61, 120.0) == "106.61"
    assert target_value(None, 1.3) == "-"


def test_hook_bench_runs_the_three_conditions_and_the_writer_batches_redis_calls() -> None:
    """The FastDeploy hooks benchmark on a short run: both sides in every condition, and the
    writer sends fewer function calls than requests (it batches the rank's decisions)."""
    from redis_layer_signals.bench import hooks

    result = hooks.run(entries=(1,), steps=20, delay_s=0.05)
    assert set(result["conditions"]) == {"healthy", "50 ms link", "outage"}
    for cases in result["conditions"].values():
        for hook in hooks.HOOKS:
            assert cases[0]["hooks"][hook]["dict"]["calls"] == cases[0]["hooks"][hook]["bridge"]["calls"] > 0
    assert result["redis_cost"]["calls_per_request"] < 1
    assert result["gc"]["frozen"] > 0  # the imports' objects, out of every full collection
    for case in (case for cases in result["conditions"].values() for case in cases):
        assert case["dict_largest_us"] > 0 and case["largest_us"] > 0 and case["full_collections"] >= 0
    report = hooks.markdown(result)
    assert "| outage | 1 | `on_kv_signal` |" in report
    assert "`gc.freeze()` after the imports" in report and "the dict's healthy" in report


def test_hook_bench_at_tp_2_pools_every_ranks_calls_in_each_condition(tmp_path: Path) -> None:
    """``--tp 2``: two bridges of one group and two dicts, driven at once; every case holds both
    ranks' calls (twice one rank's), per hook, on both sides, and the report says TP 2."""
    from redis_layer_signals.bench import hooks

    result = hooks.run(entries=(1, 2), steps=10, delay_s=0.05, tp=2, cpu_steps=20)
    assert result["tp"] == 2 and set(result["load_average"]) == {"start", "end"}
    assert set(result["conditions"]) == {"healthy", "50 ms link", "outage"}
    for cases in result["conditions"].values():
        assert [case["entries"] for case in cases] == [1, 2]
        for case in cases:
            calls = {"on_kv_signal": 2 * 10, "on_cache_task": case["entries"] * 10}
            calls["on_task_finished"] = calls["on_cache_task"]
            assert case["tp"] == 2
            for hook in hooks.HOOKS:
                figures = case["hooks"][hook]
                assert figures["dict"]["calls"] == figures["bridge"]["calls"] == 2 * calls[hook]
                assert figures["bridge"]["p50_us"] <= figures["bridge"]["p99_us"] <= figures["bridge"]["max_us"]
                assert figures["p50_ratio"] > 0
            assert case["largest_us"] == max(h["bridge"]["max_us"] for h in case["hooks"].values())
            assert case["group_fed"] == 2 * 2 * case["entries"] * 10  # ranks x chunks x entries x steps
            assert 0 <= case["group_released"] <= case["group_fed"]
    assert result["redis_cost"]["requests"] == 2 * 8 * 20
    report = hooks.markdown(result)
    assert report.startswith("# The FastDeploy bridge's hooks against FastDeploy's dict, TP 2")
    assert "2 ranks of one tensor-parallel group (`nranks=2`)" in report
    assert report.count("| outage |") == 2 * len(hooks.HOOKS)
    assert "the worst hook per condition: healthy bridge p99 " in report and "over 2 ranks" in report
    assert "The group's queue at each case's end" in report


def test_hook_bench_refuses_a_tp_outside_1_to_8() -> None:
    from redis_layer_signals.bench import hooks

    with pytest.raises(SystemExit):
        hooks.main(["--tp", "9"])
    with pytest.raises(ValueError, match="tp must be 1 to 8, got 0"):
        hooks.run(tp=0)


def test_rls_bench_hooks_forwards_tp_and_refuses_one_out_of_range(monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from redis_layer_signals.bench import hooks
    from redis_layer_signals.cli import app

    forwarded: list[list[str]] = []
    monkeypatch.setattr(hooks, "main", lambda argv: forwarded.append(list(argv)) or 0)
    assert CliRunner().invoke(app, ["bench", "--hooks", "--tp", "8", "--step-ms", "0"]).exit_code == 0
    assert forwarded == [["--tp", "8", "--step-ms", "0.0"]]
    refused = CliRunner().invoke(app, ["bench", "--hooks", "--tp", "9"])
    assert refused.exit_code == 2 and not forwarded[1:]


def test_tp_bad_day_reports_every_row_at_every_tp_size(tmp_path: Path) -> None:
    """benchmarks/tp_bad_day.py at its smallest: every row runs at TP 1 and 2 on servers it starts,
    each run's requests are all accounted for (a delay or "never"), and the table prints every
    row. How long anything waited is the benchmark's report, not a test."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "tp_bad_day.py"
    out = tmp_path / "tp_bad_day.json"
    options = ["--quick", "--tp", "1,2", "--seconds", "1.5", "--outage", "1", "--disrupt-at", "0.8", "--grace", "1"]
    done = subprocess.run(
        [sys.executable, str(script), *options, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    cases = json.loads(out.read_text())["runs"]
    rows = ("aborted", "paused", "black_hole", "restart", "nranks")
    assert [(case["row"], case["tp"]) for case in cases] == [(row, tp) for row in rows for tp in (1, 2)]
    for case in cases:
        line = next(line for line in done.stdout.splitlines() if line.startswith(f"| {case['row']} | {case['tp']}"))
        if case.get("skipped"):
            assert case["row"] == "nranks" and case["tp"] == 1
            continue
        assert case["requests"] == len(case["per_request"]) > 0
        never = sum(request["added_delay_s"] is None for request in case["per_request"])
        assert case["never"] == never and 0 <= case["delayed"] <= case["requests"] - never
        assert len(case["batches_per_rank"]) == len(case["health"]) == case["tp"]
        assert line.split(" | ")[2] == str(case["requests"])
    assert [case["aborted"] != [] for case in cases if not case.get("skipped")] == [True] * 4 + [False] * 5
