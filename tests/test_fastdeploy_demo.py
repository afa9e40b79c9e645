"""``python -m redis_layer_signals.fastdeploy`` as a newcomer meets it: its help, a run without
paddle, a run whose Redis never answers, and a run that runs out of time.

Each run is a subprocess, the way the guide has users start it; paddle is made unimportable
there (``sys.modules["paddle"] = None``, as if it were not installed), which also spares each run
the second it takes to import."""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

import pytest

from redis_layer_signals.fastdeploy.__main__ import main
from redis_layer_signals.fastdeploy.demo.workload import run
from tests.servers import RedisServer, free_port

WITHOUT_PADDLE = (
    "import runpy, sys; sys.modules['paddle'] = None; sys.argv[0] = 'demo'; "
    "runpy.run_module('redis_layer_signals.fastdeploy', run_name='__main__')"
)
"""Runs the demo with paddle unimportable; the demo's options follow it on the command line."""
MARGIN_S = 30.0
"""What a run may take past its ``--timeout`` before the test gives up on it: far more than the
few seconds stopping takes, far less than the several timeouts the run once waited in a row."""
OPTIONS = ("--url", "--namespace", "--requests", "--layers", "--seed", "--adder-process", "--timeout")


def demo(*args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-c", WITHOUT_PADDLE, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)


def nowhere() -> str:
    """A Redis URL nothing listens on: a mistyped port."""
    return f"redis://127.0.0.1:{free_port()}/0"


def test_the_demo_runs_on_numpy_when_paddle_is_not_installed() -> None:
    """The guide's quick start installs the fastdeploy extra, which has no paddle: the demo used
    to end in a traceback asking for an extra that is not on the index."""
    done = demo("--requests", "12")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and done.stderr == ""
    lines = done.stdout.splitlines()
    assert lines[0] == "signal tensors: numpy (paddle is not installed)"
    assert "requests finished: 12/12" in done.stdout and lines[-1] == "lost nothing"


def test_a_demo_whose_redis_never_answers_says_so_last_and_exits_3() -> None:
    """A mistyped URL used to look like success: exit 0, "lost nothing", and 157 lines of
    tracebacks on stderr. The run serves its process locally (nothing is lost there), says in
    its last line that Redis never answered and why, and the outage is one warning line."""
    url = nowhere()
    done = demo("--url", url, "--requests", "8")
    assert done.returncode == 3, done.stdout + done.stderr
    last = done.stdout.splitlines()[-1]
    assert last.startswith(f"served locally: Redis at {url} never answered (")
    assert "Connection refused" in last
    assert "Traceback" not in done.stderr
    warnings = done.stderr.splitlines()
    assert 1 <= len(warnings) <= 2 and all(line.startswith("fastdeploy demo: warning: ") for line in warnings)


@pytest.mark.timeout(300)
def test_the_demo_with_its_adder_in_another_process_keeps_its_timeout_when_redis_never_answers() -> None:
    """Across processes every handoff needs Redis: with none answering, the run used to wait
    out its timeout several times over (killed at twice it), with chained tracebacks. It ends
    within its timeout and a few seconds, kills its child, and says why nothing finished."""
    url = nowhere()
    timeout_s = 30
    done = demo("--url", url, "--adder-process", "--timeout", str(timeout_s), timeout_s=timeout_s + MARGIN_S)
    assert done.returncode == 3, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1].startswith(f"served locally: Redis at {url} never answered (")
    assert "PROBLEMS: " in done.stdout and "requests never finished" in done.stdout
    assert "Traceback" not in done.stderr
    assert all(line.startswith("fastdeploy demo: ") for line in done.stderr.splitlines())


def test_a_run_that_runs_out_of_time_says_so_instead_of_raising(redis_server: RedisServer, namespace: str) -> None:
    """The messager stops consuming (its threads end) after the first forward step: the run
    used to raise TimeoutError out of the driver, a traceback at the command line; now it
    returns what it saw, and its problems say that the run ran out of time."""

    def stall(step: int, messager: Any) -> None:
        if step == 1:
            messager.stop()

    outcome = run(redis_server.url, namespace, requests=6, timeout_s=2.0, on_step=stall)
    assert outcome.timed_out == 2.0
    problems = outcome.problems()
    assert problems[0] == "the run did not end within its timeout of 2s"
    assert any("requests never finished" in problem for problem in problems)
    assert outcome.unanswered(redis_server.url) is None, "Redis answered: the run says nothing of it"


def help_text(capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    return capsys.readouterr().out


def test_the_help_has_a_short_summary_no_markup_and_describes_every_option(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The help used to show the docstring's ``paddle`` markup and nothing for --requests,
    --layers or --seed."""
    text = help_text(capsys)
    assert "``" not in text
    summary = text.split("\n\n")[1]
    assert summary.startswith("Run the reference cache messager") and len(summary.splitlines()) <= 4
    options = text.split("options:\n", 1)[1]
    for option in OPTIONS:
        # The option's line, then its description: on that line, or on the next when it is long.
        found = re.search(rf"^  {option}(?: [A-Z]+)?(?: +(\S.*))?\n(?: {{10,}}(\S.*))?", options, re.MULTILINE)
        assert found is not None, option
        assert found.group(1) or found.group(2), f"{option} has no description"
    assert "exit codes: 0 nothing lost; 1 " in " ".join(text.split())


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--requests", "0"], "--requests"),
        (["--requests", "512"], "--requests"),
        (["--layers", "zero"], "--layers"),
        (["--timeout", "-1"], "--timeout"),
        (["--adder-process", "--url", "memory://"], "--adder-process"),
    ],
)
def test_a_bad_option_exits_2_naming_it(args: list[str], named: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(args)
    assert exited.value.code == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert error.startswith("python -m redis_layer_signals.fastdeploy: error: ") and named in error
