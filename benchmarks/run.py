"""Run the benchmark: ``python benchmarks/run.py [--redis URL] [--json] [--out DIR]``.

The logic lives in :mod:`redis_layer_signals.bench` (also ``rls bench``); this file only makes
it runnable from a checkout.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from redis_layer_signals.bench import main

if __name__ == "__main__":
    raise SystemExit(main())
