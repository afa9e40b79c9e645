"""``python -m redis_layer_signals.fastdeploy``: run the reference messager on a mixed workload
and say whether anything was lost; exits 1 if so. Needs the ``paddle`` extra."""

from __future__ import annotations

import argparse
import sys
import uuid
from collections.abc import Sequence

from ..config import BufferConfig
from .demo.workload import run


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m redis_layer_signals.fastdeploy", description=__doc__)
    parser.add_argument("--url", default=None, help="default: RLS_REDIS_URL, then memory://")
    parser.add_argument("--namespace", default=None, help="default: a fresh one per run")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--adder-process", action="store_true", help="run the cache-task adder in its own process")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds the whole run may take")
    args = parser.parse_args(argv)
    namespace = args.namespace or f"fastdeploy-{uuid.uuid4().hex[:8]}"
    outcome = run(
        args.url or BufferConfig.resolve().url,
        namespace,
        requests=args.requests,
        seed=args.seed,
        layers=args.layers,
        adder_process=args.adder_process,
        timeout_s=args.timeout,
    )
    stats = outcome.stats
    print(f"requests finished: {len(outcome.finished)}/{len(outcome.plans)} in {outcome.seconds:.2f}s")
    print(f"block writes: {sum(outcome.block_writes.values())} (expected {len(outcome.expected())})")
    if stats is None:
        print("layer-0 signals: Redis could not be read at the end")
    else:
        print(
            f"layer-0 signals: {stats['recorded']} recorded, {stats['delivered']} delivered at once, "
            f"{stats['recovered']} recovered by registration, {stats['superseded']} superseded"
        )
    problems = outcome.problems()
    print("lost nothing" if not problems else "PROBLEMS: " + "; ".join(problems))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
