"""The wheel carries the Lua library's files and works from outside the source tree after a plain
install into a clean virtual environment (memory:// included: it is the default URL)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import venv
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SMOKE = textwrap.dedent(
    """
    import redis_layer_signals, sys
    from redis_layer_signals import CacheTask, SignalBuffer
    from redis_layer_signals.scripts import library
    assert "site-packages" in redis_layer_signals.__file__, redis_layer_signals.__file__
    buf = SignalBuffer.from_url(sys.argv[1], namespace="wheel")
    assert [s.slot for s in buf.record("p0", 0, 0, [(5, 100)]).buffered] == [5]
    rec = buf.register(CacheTask("p0", 0, 5, "req-1", need_prefill_tokens=100, num_layers=1))
    assert [s.tokens for s in rec.recovered] == [100]
    print("ok", library().name)
    """
)


def test_wheel_ships_lua_and_works_in_a_clean_venv(tmp_path: Path, redis_server: object) -> None:
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(ROOT)],
        check=True,
        timeout=300,
    )
    (wheel,) = dist.glob("redis_layer_signals-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for script in ("_lib.lua", "record.lua", "register.lua", "finish.lua", "sweep.lua"):
        assert f"redis_layer_signals/lua/{script}" in names
    assert "redis_layer_signals/py.typed" in names

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
