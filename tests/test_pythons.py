"""`make test` runs the behaviour suite on every other supported Python; an interpreter it cannot
find fails the run and names it, instead of being skipped."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def make_variable(name: str) -> str:
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    match = re.search(rf"^{name} :?= (.*)$", text, re.MULTILINE)
    assert match is not None, name
    return match.group(1)


def test_make_runs_the_behaviour_suite_on_every_other_supported_python() -> None:
    classifiers = re.findall(r'"Programming Language :: Python :: (3\.\d+)"', (ROOT / "pyproject.toml").read_text())
    supported = set(classifiers)
    others = set(make_variable("OTHER_PYTHONS").split())
    assert others | {"3.11"} == supported == {"3.10", "3.11", "3.12", "3.13"}
    test_rule = re.search(r"^test: (.*)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert test_rule is not None and "pythons" in test_rule.group(1).split()


def test_a_missing_interpreter_fails_the_run_naming_it(tmp_path: Path) -> None:
    make = shutil.which("make")
    assert make is not None, "make is not installed"
    done = subprocess.run(
        [make, "-s", "-C", str(ROOT), ".venv-3.99/.installed-stamp", f"PYENV_ROOT={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "Python 3.99 is missing" in done.stderr, done.stderr
    assert not (ROOT / ".venv-3.99").exists()
