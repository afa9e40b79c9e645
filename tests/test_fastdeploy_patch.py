"""`rls fastdeploy patch`: the integration guide applied to a cache_messager.py by a codemod.

It runs on a fixture written here with the structure of FastDeploy's file (FastDeploy's code stays
out of the repository): --check, the rewrite with FILE.orig, --output, idempotence, every byte
outside the patched places kept, another structure refused, and the patched messager's hooks
reaching a bridge (the fixture executed with stub imports)."""

from __future__ import annotations

import ast
import difflib
import os
import subprocess
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

import redis_layer_signals
import redis_layer_signals.fastdeploy
from redis_layer_signals import cli
from redis_layer_signals.fastdeploy import patch
from redis_layer_signals.fastdeploy.patch import StructureMismatch, patch_source

FIXTURE = Path(__file__).parent / "fixtures" / "fastdeploy" / "cache_messager.py"
ORIGINAL = FIXTURE.read_bytes()
TIMEOUT_S = 60


@dataclass
class Done:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def rls(capsys: pytest.CaptureFixture[str]) -> Callable[..., Done]:
    """``rls ARGS`` in this process (the command's own code path, exit code included)."""

    def run(*args: str) -> Done:
        with pytest.raises(SystemExit) as exited:
            cli.main(list(args))
        captured = capsys.readouterr()
        code = exited.value.code
        return Done(code if isinstance(code, int) else 1, captured.out, captured.err)

    return run


@pytest.fixture
def messager_file(tmp_path: Path) -> Path:
    target = tmp_path / "cache_messager.py"
    target.write_bytes(ORIGINAL)
    return target


def patched_text() -> str:
    return patch_source(ORIGINAL).patched.decode()


# -- the command ------------------------------------------------------------------------------


def test_check_prints_the_diff_exits_1_and_writes_nothing(rls: Callable[..., Done], messager_file: Path) -> None:
    done = rls("fastdeploy", "patch", str(messager_file), "--check")
    assert done.returncode == 1, done.stderr
    assert done.stdout.startswith("--- a/cache_messager.py\n+++ b/cache_messager.py\n")
    assert "+        self.layer0 = Layer0Bridge(\n" in done.stdout
    assert "-        self.pending_layer0_signals = {}\n" in done.stdout
    assert messager_file.read_bytes() == ORIGINAL
    assert list(messager_file.parent.iterdir()) == [messager_file]


def test_patch_rewrites_the_file_keeps_the_original_and_a_second_run_changes_nothing(
    rls: Callable[..., Done], messager_file: Path
) -> None:
    done = rls("fastdeploy", "patch", str(messager_file))
    assert done.returncode == 0, done.stderr
    backup = messager_file.with_name("cache_messager.py.orig")
    assert backup.read_bytes() == ORIGINAL
    assert messager_file.read_text() == patched_text()
    assert sorted(p.name for p in messager_file.parent.iterdir()) == ["cache_messager.py", "cache_messager.py.orig"]

    check = rls("fastdeploy", "patch", str(messager_file), "--check")
    assert check.returncode == 0, check.stdout + check.stderr
    assert "already patched" in check.stdout and "@@" not in check.stdout
    again = rls("fastdeploy", "patch", str(messager_file))
    assert again.returncode == 0, again.stderr
    assert messager_file.read_text() == patched_text()
    assert backup.read_bytes() == ORIGINAL  # the second run did not overwrite the original with the patched file


def test_the_diff_names_the_path_as_given_and_the_rewrite_keeps_the_file_s_mode(
    rls: Callable[..., Done], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "fastdeploy" / "cache_manager" / "cache_messager.py"
    target.parent.mkdir(parents=True)
    target.write_bytes(ORIGINAL)
    target.chmod(0o640)
    monkeypatch.chdir(tmp_path)
    check = rls("fastdeploy", "patch", "fastdeploy/cache_manager/cache_messager.py", "--check")
    assert check.returncode == 1
    assert check.stdout.startswith(
        "--- a/fastdeploy/cache_manager/cache_messager.py\n+++ b/fastdeploy/cache_manager/cache_messager.py\n"
    )
    assert rls("fastdeploy", "patch", "fastdeploy/cache_manager/cache_messager.py").returncode == 0
    assert target.stat().st_mode & 0o777 == 0o640
    assert target.with_name("cache_messager.py.orig").stat().st_mode & 0o777 == 0o640


def test_output_writes_the_patched_file_elsewhere_and_leaves_the_file_alone(
    rls: Callable[..., Done], messager_file: Path
) -> None:
    out = messager_file.with_name("patched.py")
    done = rls("fastdeploy", "patch", str(messager_file), "--output", str(out))
    assert done.returncode == 0, done.stderr
    assert out.read_text() == patched_text()
    assert messager_file.read_bytes() == ORIGINAL
    assert sorted(p.name for p in messager_file.parent.iterdir()) == ["cache_messager.py", "patched.py"]


def test_another_structure_is_refused_with_exit_2_naming_the_place_and_nothing_written(
    rls: Callable[..., Done], messager_file: Path
) -> None:
    text = ORIGINAL.decode()
    # Another release: the consumer queues its ready batch without the `if` the guide removes.
    other = text.replace(
        "                if ready_engine_signals:\n                    self.cache_prefilled_engine_ids_queue.put",
        "                self.cache_prefilled_engine_ids_queue.put",
    )
    assert other != text
    messager_file.write_text(other)
    done = rls("fastdeploy", "patch", str(messager_file))
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith(f"rls: error: {messager_file}: CacheMessagerV1.consume_signals (def at line ")
    assert "`if ready_engine_signals:`" in done.stderr and "nothing written" in done.stderr
    assert "Traceback" not in done.stderr
    assert messager_file.read_text() == other
    assert not messager_file.with_name("cache_messager.py.orig").exists()
    assert rls("fastdeploy", "patch", str(messager_file), "--check").returncode == 2


def test_without_libcst_the_command_names_the_extra_to_install(messager_file: Path) -> None:
    code = "import sys; sys.modules['libcst'] = None; from redis_layer_signals.cli import main; main(sys.argv[1:])"
    environment = {k: v for k, v in os.environ.items() if not k.startswith("RLS_")}
    done = subprocess.run(
        [sys.executable, "-c", code, "fastdeploy", "patch", str(messager_file)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=environment,
    )
    assert done.returncode == 1
    assert "needs libcst" in done.stderr and "redis-layer-signals[fastdeploy]" in done.stderr
    assert "Traceback" not in done.stderr
    assert messager_file.read_bytes() == ORIGINAL


# -- what the codemod changes, and what it keeps ------------------------------------------------


def changed_lines() -> tuple[list[str], list[str]]:
    before, after = ORIGINAL.decode().splitlines(), patched_text().splitlines()
    removed: list[str] = []
    added: list[str] = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=before, b=after, autojunk=False).get_opcodes():
        if tag in ("replace", "delete"):
            removed += before[i1:i2]
        if tag in ("replace", "insert"):
            added += after[j1:j2]
    return removed, added


def test_only_the_guide_s_lines_change_every_other_byte_stays() -> None:
    removed, added = changed_lines()
    inserted = [*patch.IMPORTS, patch.BRIDGE, patch.ON_KV_SIGNAL, patch.ON_CACHE_TASK, patch.ON_TASK_FINISHED]
    assert sorted(line.strip() for line in added) == sorted(
        line.strip() for block in inserted for line in block.splitlines()
    )
    assert {line.strip() for line in removed} >= {
        "self.pending_layer0_signals = {}",
        "self.pending_layer0_signal_lock = threading.Lock()",
        "ready_engine_signals = []",
        "pending_engine_signals = []",
        "if layer_id == 0:",
        "if ready_engine_signals:",
        "if recovered_signal is not None:",
        "self.pending_layer0_signals.pop(current_id, None)",
    }
    assert len(removed) == 27
    # Every removed line was about the pending dict, its lock, the two lists or their logs.
    words = ("pending_layer0_signal", "engine_signals", "recovered_signal", "layer_id == 0", "logger.", "else:", "if ")
    assert all(any(w in line for w in words) for line in removed), removed
    # The older class and the module around the imports are byte for byte as they were.
    older = ORIGINAL.decode().split("class CacheMessager:")[1].split("class CacheMessagerV1:")[0]
    assert older in patched_text()
    assert patched_text().endswith(ORIGINAL.decode().split('logger.error(f"consumer: {e}")')[1])


def test_the_bridge_is_built_after_the_queue_and_before_the_threads_start() -> None:
    text = patched_text().split("class CacheMessagerV1:")[1]
    queue_at = text.index("self.cache_prefilled_engine_ids_queue = queue.Queue()")
    bridge_at = text.index("self.layer0 = Layer0Bridge(")
    threads_at = text.index("threading.Thread(target=self.consume_signals")
    assert queue_at < bridge_at < threads_at
    assert "ready=lambda: self.cache_prefilled_engine_ids_queue," in text
    assert "SignalBuffer.from_url()," in text  # the environment decides every option (RLS_RETRY_S included)


def test_patching_the_patched_file_changes_nothing() -> None:
    once = patch_source(ORIGINAL)
    twice = patch_source(once.patched)
    assert once.changed and not twice.changed
    assert twice.diff("x") == ""


def variant(old: str, new: str) -> bytes:
    text = ORIGINAL.decode()
    assert text.count(old) == 1, old
    return text.replace(old, new).encode()


@pytest.mark.parametrize(
    ("source", "place", "problem"),
    [
        pytest.param(
            variant("class CacheMessagerV1:", "class CacheMessagerV2:"), "module", "class CacheMessagerV1", id="class"
        ),
        pytest.param(variant("import paddle\n", ""), "module", "`import paddle`", id="imports"),
        pytest.param(
            variant("        self.pending_layer0_signals = {}\n", ""),
            "CacheMessagerV1.__init__",
            "`self.pending_layer0_signals = {}`",
            id="pre-fix-init",
        ),
        pytest.param(
            variant(
                'if splitwise_role == "prefill":\n            threading',
                'if splitwise_role != "mixed":\n            threading',
            ),
            "CacheMessagerV1.__init__",
            "consumer and adder threads",
            id="threads",
        ),
        pytest.param(
            variant("                ready_engine_signals = []\n", ""),
            "CacheMessagerV1.consume_signals",
            "`ready_engine_signals = []`",
            id="lists",
        ),
        pytest.param(
            variant(
                '                            logger.info(f"early signal {recovered_signal} handed to its task")\n',
                "                            self.metrics.recovered(recovered_signal)\n",
            ),
            "CacheMessagerV1._add_cache_task_thread",
            "calls `self.metrics.recovered`",
            id="unknown-code-in-a-removed-block",
        ),
        pytest.param(
            variant(
                "                                with self.pending_layer0_signal_lock:\n"
                "                                    self.pending_layer0_signals.pop(current_id, None)\n",
                "",
            ),
            "CacheMessagerV1.prefill_layerwise_send_cache_thread",
            "0 `with self.pending_layer0_signal_lock:`",
            id="sender",
        ),
        pytest.param(
            variant(
                "                    if pending_engine_signals:\n                        with",
                "                    if pending_engine_signals and True:\n                        with",
            ),
            "CacheMessagerV1.consume_signals",
            "`if pending_engine_signals:`",
            id="nested-if",
        ),
    ],
)
def test_a_file_the_codemod_does_not_know_is_refused_naming_the_first_place(
    source: bytes, place: str, problem: str
) -> None:
    with pytest.raises(StructureMismatch) as refused:
        patch_source(source)
    assert refused.value.place.startswith(place)
    assert problem in str(refused.value)


def test_a_bridge_moved_after_the_threads_is_refused() -> None:
    text = patched_text()
    start = text.index("        # redis-layer-signals: early layer-0")
    end = text.index("        )\n", start) + len("        )\n")
    bridge = text[start:end]
    moved = text.replace(bridge, "").replace(
        '        logger.info("messager ready")', bridge + '        logger.info("messager ready")'
    )
    with pytest.raises(StructureMismatch, match="not between the queue and the threads"):
        patch_source(moved.encode())


# -- the patched messager runs: its hooks reach the bridge, in the guide's order ------------------


class Stop(BaseException):
    """Ends a messager loop (its `except Exception` does not catch it)."""


class StubBuffer:
    calls: ClassVar[list[dict[str, Any]]] = []

    @classmethod
    def from_url(cls, *args: Any, **kwargs: Any) -> StubBuffer:
        cls.calls.append({"args": args, "kwargs": kwargs})
        return cls()


class StubBridge:
    """Records each hook call with what the messager held at that moment."""

    def __init__(self, buffer: Any, instance: str, rank: int, block_size: int, *, num_layers: int, ready: Any) -> None:
        self.buffer, self.instance, self.rank = buffer, instance, rank
        self.block_size, self.num_layers, self.ready = block_size, num_layers, ready
        self.events: list[tuple[Any, ...]] = EVENTS
        self.messager: Any = None

    def on_kv_signal(self, kv_signal_data: Any) -> list[tuple[int, int]]:
        progress = self.messager.engine_cache_tasks[int(kv_signal_data[2])]
        self.events.append(("on_kv_signal", int(kv_signal_data[1]), dict(progress)))
        return []

    def on_cache_task(self, cache_info: dict[str, Any]) -> list[tuple[int, int]]:
        slot = cache_info["current_id"]
        self.events.append(("on_cache_task", slot, self.messager.idx_cache_task_dict.get(slot) is cache_info))
        return []

    def on_task_finished(self, current_id: int, request_id: str) -> None:
        self.events.append(("on_task_finished", current_id, request_id))


EVENTS: list[tuple[Any, ...]] = []


class StubWorkerQueue:
    def __init__(self, **kwargs: Any) -> None:
        self.cache_infos: list[list[dict[str, Any]]] = []
        self.finish_add_cache_task_barrier = types.SimpleNamespace(wait=lambda: EVENTS.append(("barrier",)))

    def get_cache_info(self) -> list[dict[str, Any]]:
        if not self.cache_infos:
            raise Stop
        return self.cache_infos.pop(0)

    def put_finished_add_cache_task_req(self, ids: list[str]) -> None:
        EVENTS.append(("task added", *ids))

    def write_cache(self, slot: int, tokens: int) -> None:
        EVENTS.append(("write_cache", slot, tokens))

    def put_finished_req(self, reqs: list[list[str]]) -> None:
        EVENTS.append(("finished", *reqs[0]))


class OneBatchQueue:
    def __init__(self, *batches: list[tuple[int, int]]) -> None:
        self.batches = list(batches)

    def get(self) -> list[tuple[int, int]]:
        if not self.batches:
            raise Stop
        return self.batches.pop(0)


def stub_modules(monkeypatch: pytest.MonkeyPatch, signals: list[list[int]]) -> None:
    def get_output_kv_signal(buffer: np.ndarray, rank_id: int, wait_flag: int) -> None:
        if not signals:
            raise Stop
        message = signals.pop(0)
        buffer[:] = -1
        buffer[: len(message)] = message

    paddle = types.ModuleType("paddle")
    paddle.full = lambda shape, fill_value, dtype: np.full(shape, fill_value, dtype=dtype)  # type: ignore[attr-defined]
    modules = {
        "paddle": paddle,
        "fastdeploy": types.ModuleType("fastdeploy"),
        "fastdeploy.cache_manager": types.ModuleType("fastdeploy.cache_manager"),
        "fastdeploy.cache_manager.ops": types.SimpleNamespace(get_output_kv_signal=get_output_kv_signal),
        "fastdeploy.inter_communicator": types.SimpleNamespace(EngineWorkerQueue=StubWorkerQueue),
        "fastdeploy.utils": types.SimpleNamespace(get_logger=lambda *a: __import__("logging").getLogger("fixture")),
    }
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(redis_layer_signals, "SignalBuffer", StubBuffer)
    monkeypatch.setattr(redis_layer_signals.fastdeploy, "Layer0Bridge", StubBridge)
    monkeypatch.setattr(StubBuffer, "calls", [])
    EVENTS.clear()


def test_the_patched_messager_calls_the_bridge_at_the_three_hook_points(monkeypatch: pytest.MonkeyPatch) -> None:
    # layer 0 then layer 1 of slot 5, 128 tokens in one chunk
    signals = [[1, 0, 5, 0, 128], [1, 1, 5, 0, 128]]
    stub_modules(monkeypatch, signals)
    namespace: dict[str, Any] = {"__name__": "patched_messager"}
    exec(compile(patched_text(), "cache_messager.py", "exec"), namespace)
    messager = namespace["CacheMessagerV1"]("mixed", "10.0.0.7", 9923, 1, 0, 2, num_layers=4)
    bridge = messager.layer0
    bridge.messager = messager
    assert StubBuffer.calls == [{"args": (), "kwargs": {}}]
    assert (bridge.instance, bridge.rank, bridge.block_size, bridge.num_layers) == ("10.0.0.7-9923", 2, 64, 4)
    assert not hasattr(messager, "pending_layer0_signals") and not hasattr(messager, "pending_layer0_signal_lock")

    # The bridge follows the attribute: a queue put in place later is the one it queues on.
    assert bridge.ready() is messager.cache_prefilled_engine_ids_queue
    replaced = OneBatchQueue([(5, 128)])
    messager.cache_prefilled_engine_ids_queue = replaced
    assert bridge.ready() is replaced

    with pytest.raises(Stop):
        messager.consume_signals()
    # Each message reaches the bridge after its progress is written under the lock.
    assert EVENTS == [
        ("on_kv_signal", 0, {"prefilled_layer_idx": 0, "prefilled_token_num": 128}),
        ("on_kv_signal", 1, {"prefilled_layer_idx": 1, "prefilled_token_num": 128}),
    ]
    assert replaced.batches == [[(5, 128)]]  # the consumer queues nothing itself any more

    EVENTS.clear()
    half = {"request_id": "r1", "current_id": 5, "need_prefill_tokens": 128, "src_block_ids": [0, 1]}
    messager.engine_worker_queue.cache_infos = [[half], [{"request_id": "r1", "dest_block_ids": [7, 8]}]]
    with pytest.raises(Stop):
        messager._add_cache_task_thread()
    # Registered after the task is in idx_cache_task_dict, and acknowledged after that.
    assert EVENTS == [("barrier",), ("on_cache_task", 5, True), ("task added", "r1"), ("barrier",)]

    EVENTS.clear()
    with pytest.raises(Stop):
        messager.prefill_layerwise_send_cache_thread()
    # The slot is released in the buffer before the engine hears the request is done.
    assert EVENTS == [("write_cache", 5, 128), ("on_task_finished", 5, "r1"), ("finished", "r1", "finished")]
    assert messager.idx_cache_task_dict == {}


def test_the_unpatched_fixture_runs_too_so_the_stubs_fit_its_structure(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same stubs drive the fixture before the patch: its own dict hands the early signal over."""
    stub_modules(monkeypatch, [[1, 0, 5, 0, 128]])
    namespace: dict[str, Any] = {"__name__": "fixture_messager"}
    exec(compile(ORIGINAL, "cache_messager.py", "exec"), namespace)
    messager = namespace["CacheMessagerV1"]("mixed", "10.0.0.7", 9923, 0, 0, 1, num_layers=4)
    with pytest.raises(Stop):
        messager.consume_signals()
    assert messager.pending_layer0_signals == {5: (5, 128)}
    half = {"request_id": "r1", "current_id": 5, "need_prefill_tokens": 128, "src_block_ids": [0, 1]}
    messager.engine_worker_queue.cache_infos = [[half], [{"request_id": "r1", "dest_block_ids": [7, 8]}]]
    with pytest.raises(Stop):
        messager._add_cache_task_thread()
    assert messager.cache_prefilled_engine_ids_queue.get_nowait() == [(5, 128)]


# -- the guide and the codemod say the same -----------------------------------------------------


def guide_fragments() -> set[str]:
    """The code of every ```python block of the guide's Patching section, comments aside."""
    page = (Path(__file__).parent.parent / "docs" / "fastdeploy.md").read_text()
    section = page.split("## Patching the fixed `CacheMessagerV1`")[1].split("\n## ")[0]
    blocks = [part.split("```")[0] for part in section.split("```python\n")[1:]]
    return {ast.dump(ast.parse(block)) for block in blocks}


@pytest.mark.parametrize(
    "inserted",
    ["\n".join(patch.IMPORTS), patch.BRIDGE, patch.ON_KV_SIGNAL, patch.ON_CACHE_TASK, patch.ON_TASK_FINISHED],
    ids=["imports", "bridge", "on_kv_signal", "on_cache_task", "on_task_finished"],
)
def test_the_codemod_inserts_exactly_the_guide_s_fragments(inserted: str) -> None:
    assert ast.dump(ast.parse(inserted)) in guide_fragments()


def test_the_guide_locates_each_place_by_the_line_the_codemod_looks_for() -> None:
    section = (Path(__file__).parent.parent / "docs" / "fastdeploy.md").read_text().split("## Patching")[1]
    for line in (patch.IMPORT_ANCHOR, patch.QUEUE_ANCHOR.rstrip(" ="), patch.THREADS, patch.TASK_LOCK):
        assert f"`{line}" in section, line
    for line in (patch.PENDING_LOCK, patch.SENDER_FINISH, "if recovered_signal is not None:", "if layer_id == 0:"):
        assert f"`{line}`" in section, line
