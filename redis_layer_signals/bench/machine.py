"""Describe the machine and versions a result was measured on, so a result can be compared."""

from __future__ import annotations

import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Any


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "absent"


def describe(redis_info: dict[str, Any]) -> dict[str, Any]:
    """CPU, cores, OS, Python, client libraries, and the server as INFO reports it."""
    return {
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "redis_py": _version("redis"),
        "hiredis": _version("hiredis"),
        "redis_version": str(redis_info.get("redis_version", "unknown")),
        "redis_mode": str(redis_info.get("redis_mode", "unknown")),
        "redis_allocator": str(redis_info.get("mem_allocator", "unknown")),
    }
