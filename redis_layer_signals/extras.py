"""How to install an optional extra (``fastdeploy``, ``bench``, ``paddle``) while nothing is
released: an install by the package's name would ask an index that has no such package, so
every message that names a missing extra gives these commands instead."""

from __future__ import annotations

WHEEL = "dist/redis_layer_signals-{version}-py3-none-any.whl"
"""The wheel ``make dist`` builds, as it is named in a clone."""


def install_hint(extra: str) -> str:
    """The commands that install ``extra`` today: from a clone, or from a wheel built by ``make dist``."""
    from . import __version__  # the package's face imports more than a message needs, so late

    wheel = WHEEL.format(version=__version__)
    clone = f"pip install '.[{extra}]' in a clone of redis-layer-signals"
    return f"{clone}, or pip install '{wheel}[{extra}]' after make dist"
