"""A one-minute tour on the embedded default: an early signal is buffered, recovered when its
task registers, and a stale one (more tokens than the request needs) is dropped."""

from __future__ import annotations

from . import CacheTask, SignalBuffer


def main() -> None:
    buf = SignalBuffer.from_url("memory://demo", namespace="demo")
    early = buf.record(instance="p0", rank=0, layer=0, entries=[(5, 2048), (7, 9000)])
    print(f"GPU signal before any task: buffered {[(s.slot, s.tokens) for s in early.buffered]}")

    rec = buf.register(CacheTask("p0", 0, 5, "req-1", need_prefill_tokens=4096, num_layers=61))
    print(f"req-1 registers on slot 5: recovered {[(s.layer, s.tokens) for s in rec.recovered]}")

    stale = buf.register(CacheTask("p0", 0, 7, "req-2", need_prefill_tokens=4096, num_layers=61))
    print(f"req-2 registers on slot 7: dropped {[(s.tokens, r.value) for s, r in stale.dropped]}")

    live = buf.record(instance="p0", rank=0, layer=1, entries=[(5, 2048)])
    print(f"layer 1 of slot 5 after registration: delivered {[(s.layer, s.tokens) for s in live.delivered]}")

    for slot, request in ((5, "req-1"), (7, "req-2")):
        buf.finish(instance="p0", rank=0, slot=slot, request_id=request)
    print(f"counters: {buf.stats()}")


if __name__ == "__main__":
    main()
