"""``python -m redis_layer_signals.fastdeploy``: the reference cache messager on a mixed workload.

Runs FastDeploy's prefill messager threads around the bridge on a scripted GPU and says whether
any request, block write or layer-0 signal was lost or repeated. Exit codes: see ``EPILOG``.
"""

from __future__ import annotations

import argparse
import re
import sys
import uuid
from collections.abc import Callable, Sequence

from ..config import BufferConfig
from ..errors import InvalidConfig
from .demo.workload import run, say_warnings

PROG = "python -m redis_layer_signals.fastdeploy"
SUMMARY = (
    "Run the reference cache messager (FastDeploy's prefill threads around the bridge) on a scripted GPU "
    "and say whether anything was lost. Needs the fastdeploy extra; uses paddle tensors if paddle is "
    "installed, numpy arrays otherwise."
)
EXIT_LOST, EXIT_USAGE, EXIT_UNANSWERED = 1, 2, 3
EPILOG = (
    "exit codes: 0 nothing lost; 1 something lost or repeated, or the run did not end within --timeout; "
    "2 a bad option; 3 Redis did not answer: the run served its process locally, as the last line says."
)
MAX_REQUESTS = 511
"""Requests of one run: one slot each, and one more slot for the closing probe (512 slots)."""
WARNING_FORMAT = "fastdeploy demo: %(levelname)s: %(message)s"  # levelname in lower case
"""How the library's warnings and errors look on stderr during a run."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=SUMMARY, epilog=EPILOG)
    parser.add_argument(
        "--url", default=None, help="Redis to buffer in (default: RLS_REDIS_URL, then memory://, in this process)"
    )
    parser.add_argument("--namespace", metavar="NS", default=None, help="key namespace (default: a fresh one per run)")
    parser.add_argument(
        "--requests",
        metavar="N",
        type=_bounded_int(1, MAX_REQUESTS),
        default=32,
        help=f"how many requests to prefill, chunked, in mixed orders (1 to {MAX_REQUESTS}; default: 32)",
    )
    parser.add_argument(
        "--layers",
        metavar="N",
        type=_bounded_int(1, 1024),
        default=4,
        help="layers the scripted model has (default: 4)",
    )
    parser.add_argument(
        "--seed", metavar="N", type=int, default=1, help="seed of the request sizes and of their order (default: 1)"
    )
    parser.add_argument(
        "--adder-process",
        action="store_true",
        help="run the cache-task adder in a process of its own, sharing only Redis (needs --url redis://...)",
    )
    parser.add_argument(
        "--timeout",
        metavar="SECONDS",
        type=_positive_float,
        default=60.0,
        help="seconds the run may take; stopping then takes at most a few more (default: 60)",
    )
    args = parser.parse_args(argv)
    url = args.url or BufferConfig.resolve().url
    if args.adder_process and url.startswith("memory://"):
        parser.error("--adder-process needs a Redis both processes reach (--url redis://...), not memory://")
    namespace = args.namespace or f"fastdeploy-{uuid.uuid4().hex[:8]}"
    say_warnings(WARNING_FORMAT)
    try:
        outcome = run(
            url,
            namespace,
            requests=args.requests,
            seed=args.seed,
            layers=args.layers,
            adder_process=args.adder_process,
            timeout_s=args.timeout,
            log_format=WARNING_FORMAT,
        )
    except InvalidConfig as exc:  # a URL or namespace the buffer refuses
        parser.error(str(exc))
    stats = outcome.stats
    paddle_note = "" if outcome.tensors == "paddle" else " (paddle is not installed)"
    print(f"signal tensors: {outcome.tensors}{paddle_note}")
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
    unanswered = outcome.unanswered(_without_password(url))
    if unanswered is not None:
        print(unanswered)
        return EXIT_UNANSWERED
    return EXIT_LOST if problems else 0


def _bounded_int(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is not in [{low}, {high}]")
        return value

    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a positive number of seconds")
    return value


def _without_password(url: str) -> str:
    """``url`` as it may be printed: its password, if any, masked."""
    return re.sub(r"(://[^/@:]*:)[^@/]+@", r"\1***@", url)


if __name__ == "__main__":
    sys.exit(main())
