"""Benchmarks of the buffer against its baselines, on one Redis server, in one run.

Importable without matplotlib (the plot is optional). Entry points: ``runner.run`` returns
the results as a dict; ``runner.main`` is the command line (``benchmarks/run.py``,
``rls bench``).
"""

from __future__ import annotations

from . import names
from .runner import BenchConfig, main, run

__all__ = ["BenchConfig", "main", "names", "run"]
