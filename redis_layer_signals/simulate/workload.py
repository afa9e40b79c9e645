"""The requests one prefill rank serves: seeded, so a run can be repeated exactly."""

from __future__ import annotations

import random
from dataclasses import dataclass

from .config import SimConfig


@dataclass(frozen=True)
class Request:
    request_id: str
    prompt_tokens: int
    early: bool  # its cache task registers after its first layer-0 signal (the race)
    abort: bool  # aborted before it ever registers
    delay_ms: float  # how long after the first layer-0 signal an early task registers

    def chunks(self, chunk_tokens: int) -> list[tuple[int, int]]:
        """[start, end) token ranges of the prefill chunks; a signal reports ``end``."""
        return [(s, min(s + chunk_tokens, self.prompt_tokens)) for s in range(0, self.prompt_tokens, chunk_tokens)]


def workload(config: SimConfig, instance: str, rank: int, run_id: str) -> list[Request]:
    rng = random.Random(f"{config.seed}/{instance}/{rank}")
    requests = []
    for i in range(config.requests):
        prompt = rng.randint(1, config.max_prompt_tokens)
        abort = rng.random() < config.abort_share
        early = not abort and rng.random() < config.early_share
        delay = rng.uniform(0.0, config.max_delay_ms)
        requests.append(Request(f"{run_id}-{instance}-{rank}-{i}", prompt, early, abort, delay))
    return requests
