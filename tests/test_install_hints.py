"""Every install hint the package, the CLI and the docs give works today: nothing is released,
so ``pip install 'redis-layer-signals[...]'`` would ask an index that has no such package."""

from __future__ import annotations

import re
from pathlib import Path

from redis_layer_signals.extras import install_hint

ROOT = Path(__file__).resolve().parent.parent
FROM_AN_INDEX = re.compile(r"pip install '?redis-layer-signals")
"""An install of the released package, by its name on an index."""


def _texts() -> list[Path]:
    package = sorted((ROOT / "redis_layer_signals").rglob("*.py"))
    return [*package, ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_no_hint_installs_from_an_index_except_after_the_first_release() -> None:
    offending = []
    for path in _texts():
        text = path.read_text(encoding="utf-8")
        for found in FROM_AN_INDEX.finditer(text):
            before = " ".join(text[max(0, found.start() - 60) : found.start()].split())
            if "after the first release" not in before.lower():
                line = text.count("\n", 0, found.start()) + 1
                offending.append(f"{path.relative_to(ROOT)}:{line}")
    assert offending == []


def test_the_hint_installs_from_a_clone_or_the_wheel_make_dist_builds() -> None:
    from redis_layer_signals import __version__

    hint = install_hint("fastdeploy")
    assert "pip install '.[fastdeploy]' in a clone" in hint
    assert f"'dist/redis_layer_signals-{__version__}-py3-none-any.whl[fastdeploy]'" in hint and "make dist" in hint
