"""The wheel and the sdist `make dist` builds: the wheel carries the Lua library's files, its
licence and its metadata (no project URL: none is published yet), both pass ``twine check``, and
the wheel works from outside the source tree after a plain install into a clean virtual
environment (memory:// included: it is the default URL), without numpy (only the ``fastdeploy``
extra needs it), running the README's first example as a new user would."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import textwrap
import venv
import zipfile
from email.parser import Parser
from pathlib import Path

import redis_layer_signals
from tests.test_docs import README, examples

ROOT = Path(__file__).resolve().parent.parent

SMOKE = textwrap.dedent(
    """
    import redis_layer_signals, sys
    from redis_layer_signals import CacheTask, SignalBuffer
    from redis_layer_signals.server.library import library
    assert "site-packages" in redis_layer_signals.__file__, redis_layer_signals.__file__
    buf = SignalBuffer.from_url(sys.argv[1], namespace="wheel")
    assert [s.slot for s in buf.record("p0", 0, 0, [(5, 100)]).buffered] == [5]
    rec = buf.register(CacheTask("p0", 0, 5, "req-1", need_prefill_tokens=100, num_layers=1))
    assert [s.tokens for s in rec.recovered] == [100]
    try:
        import numpy  # noqa: F401
    except ModuleNotFoundError:
        pass
    else:
        raise AssertionError("the base install pulled numpy in")
    try:
        import redis_layer_signals.fastdeploy  # noqa: F401
    except ModuleNotFoundError as error:
        assert "pip install '.[fastdeploy]' in a clone" in str(error), error
    else:
        raise AssertionError("redis_layer_signals.fastdeploy imported without numpy")
    print("ok", library().name)
    """
)

PYTHONS = ("3.10", "3.11", "3.12", "3.13")


def readme_first_example() -> tuple[str, str]:
    """The README's first Python example and what its ``print`` line says it prints."""
    code = examples(README)[0].code
    printed = [line.split("#", 1)[1].strip() for line in code.splitlines() if line.startswith("print(") and "#" in line]
    assert len(printed) == 1, "the README's first example prints one line and says what in a comment"
    return code, printed[0]


def test_wheel_ships_lua_and_works_in_a_clean_venv(tmp_path: Path, redis_server: object) -> None:
    # As `make dist` builds them (python -m build: the sdist, then the wheel from the sdist), with
    # the backend of the dev extra instead of a download.
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = dist.glob("redis_layer_signals-*.whl")
    (sdist,) = dist.glob("redis_layer_signals-*.tar.gz")
    checked = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", str(wheel), str(sdist)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.count("PASSED") == 2, checked.stdout
    with tarfile.open(sdist) as archive:
        top = sdist.name.removesuffix(".tar.gz")
        in_sdist = {name.removeprefix(f"{top}/") for name in archive.getnames()}
    for needed in (
        "pyproject.toml",
        "README.md",
        "LICENSE",
        "Makefile",
        "lua/record.lua",
        "redis_layer_signals/__init__.py",
    ):
        assert needed in in_sdist, needed

    names = zipfile.ZipFile(wheel).namelist()
    for script in ("_lib.lua", "record.lua", "register.lua", "finish.lua", "sweep.lua"):
        assert f"redis_layer_signals/lua/{script}" in names
    assert "redis_layer_signals/py.typed" in names

    # The licence, in dist-info/licenses/ (PEP 639), the same text as the repository's.
    (licence,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
    assert zipfile.ZipFile(wheel).read(licence) == (ROOT / "LICENSE").read_bytes()
    assert b"Apache License" in (ROOT / "LICENSE").read_bytes()
    meta = Parser().parsestr(zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode())
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta.get_all("License-File") == ["LICENSE"]
    classifiers = meta.get_all("Classifier")
    for version in PYTHONS:
        assert f"Programming Language :: Python :: {version}" in classifiers
    assert any(c.startswith("Development Status :: ") for c in classifiers)
    # A project URL names a page that exists; none is published yet, so there is none.
    assert meta.get_all("Project-URL") is None, meta.get_all("Project-URL")
    assert meta["Requires-Python"] == ">=3.10"
    numpy_requirements = [r for r in meta.get_all("Requires-Dist") if r.startswith("numpy")]
    assert numpy_requirements and all("extra ==" in r for r in numpy_requirements), numpy_requirements

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", str(wheel)], check=True, timeout=600)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    clean_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    for url in ("memory://", redis_server.url):  # type: ignore[attr-defined]
        done = subprocess.run(
            [str(python), "-c", SMOKE, url], cwd=outside, env=clean_env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("ok ")

    code, printed = readme_first_example()
    first = subprocess.run(
        [str(python), "-c", code], cwd=outside, env=clean_env, capture_output=True, text=True, timeout=120
    )
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip() == printed

    rls = env_dir / "bin" / "rls"
    version = subprocess.run([str(rls), "--version"], cwd=outside, env=clean_env, capture_output=True, text=True)
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == f"rls {meta['Version']}"
    simulated = subprocess.run(
        [str(rls), "simulate", "--requests", "8", "--ranks", "1"],
        cwd=outside,
        env=clean_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert simulated.returncode == 0, simulated.stderr
    assert "OK" in simulated.stdout


def test_rls_version_prints_the_package_version() -> None:
    from typer.testing import CliRunner

    from redis_layer_signals.cli import app

    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"rls {redis_layer_signals.__version__}"
