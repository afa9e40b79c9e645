"""`rls fastdeploy patch`: the integration guide applied to a cache_messager.py by a codemod.

It runs on fixtures written here with the structure of FastDeploy's file, one per release the codemod
knows (FastDeploy's code stays out of the repository): --check, the rewrite with FILE.orig, --output,
idempotence, every byte outside the patched places kept, code it does not know refused naming its
line, hostile files refused in one line, and the patched messager's hooks reaching a bridge (the
fixture executed with stub imports)."""

from __future__ import annotations

import ast
import difflib
import os
import re
import shutil
import subprocess
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import redis_layer_signals
import redis_layer_signals.fastdeploy
from redis_layer_signals import cli
from redis_layer_signals.extras import install_hint
from redis_layer_signals.fastdeploy import patch
from redis_layer_signals.fastdeploy.patch import StructureMismatch, UnreadableSource, patch_source
from tests.servers import Done

FIXTURES = Path(__file__).parent / "fixtures" / "fastdeploy"
FIXTURE = FIXTURES / "cache_messager.py"
"""release/2.6 with PR 7872."""
FIXTURE_8035 = FIXTURES / "cache_messager_8035.py"
"""release/2.6 after PR 8035: every layer-0 entry goes through the pending dict."""
ORIGINAL = FIXTURE.read_bytes()
ORIGINAL_8035 = FIXTURE_8035.read_bytes()
BOTH = pytest.mark.parametrize("original", [ORIGINAL, ORIGINAL_8035], ids=["pr7872", "pr8035"])
TIMEOUT_S = 60


@pytest.fixture
def messager_file(tmp_path: Path) -> Path:
    target = tmp_path / "cache_messager.py"
    target.write_bytes(ORIGINAL)
    return target


def line_of(text: str | bytes, needle: str) -> int:
    """The line of the file where ``needle`` first stands."""
    data = text.encode() if isinstance(text, str) else text
    return data[: data.index(needle.encode())].count(b"\n") + 1


NUL = "\x00"
PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR"


def patched_text() -> str:
    return patch_source(ORIGINAL).patched.decode()


# -- the command ------------------------------------------------------------------------------


def test_check_prints_the_diff_exits_1_and_writes_nothing(rls: Callable[..., Done], messager_file: Path) -> None:
    done = rls("fastdeploy", "patch", str(messager_file), "--check")
    assert done.returncode == 1, done.stderr
    assert done.stdout.startswith("--- a/cache_messager.py\n+++ b/cache_messager.py\n")
    assert "+        self.layer0 = bridge_for_messager(\n" in done.stdout
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


def fastdeploy_checkout(tmp_path: Path, source: bytes = ORIGINAL) -> Path:
    """``<tmp>/FastDeploy/fastdeploy/cache_manager/cache_messager.py``; returns the file."""
    target = tmp_path / "FastDeploy" / "fastdeploy" / "cache_manager" / "cache_messager.py"
    target.parent.mkdir(parents=True)
    target.write_bytes(source)
    return target


def apply_with_patch_program(diff: bytes, root: Path, target: Path, expected: bytes) -> None:
    """``patch -p1`` from ``root`` applies ``diff`` and leaves ``expected``; without the program,
    the header names the path ``patch -p1`` would open from there."""
    relative = target.relative_to(root).as_posix()
    assert diff.startswith(f"--- a/{relative}\n+++ b/{relative}\n".encode())
    program = shutil.which("patch")
    if program is None:
        return
    applied = subprocess.run(
        [program, "-p1", "--no-backup-if-mismatch"], input=diff, cwd=root, capture_output=True, timeout=TIMEOUT_S
    )
    assert applied.returncode == 0, applied.stdout + applied.stderr
    assert target.read_bytes() == expected


def test_the_diff_is_relative_to_fastdeploy_s_root_so_patch_p1_applies_it_there(
    tmp_path: Path, capsysbinary: pytest.CaptureFixture[bytes]
) -> None:
    target = fastdeploy_checkout(tmp_path)
    root = tmp_path / "FastDeploy"
    with pytest.raises(SystemExit) as exited:  # an absolute path: the header still starts at the root
        cli.main(["fastdeploy", "patch", str(target), "--check"])
    assert exited.value.code == 1
    diff = capsysbinary.readouterr().out
    apply_with_patch_program(diff, root, target, patch_source(ORIGINAL).patched)


def test_root_names_the_directory_the_diff_is_relative_to(
    rls: Callable[..., Done], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = fastdeploy_checkout(tmp_path)
    monkeypatch.chdir(target.parent)
    done = rls("fastdeploy", "patch", "cache_messager.py", "--check", "--root", str(tmp_path))
    assert done.returncode == 1, done.stderr
    assert done.stdout.startswith("--- a/FastDeploy/fastdeploy/cache_manager/cache_messager.py\n")
    elsewhere = rls("fastdeploy", "patch", "cache_messager.py", "--check", "--root", str(tmp_path / "other"))
    assert elsewhere.returncode == 2 and "does not hold" in elsewhere.stderr
    assert "Traceback" not in elsewhere.stderr


def test_the_rewrite_keeps_the_file_s_mode(rls: Callable[..., Done], tmp_path: Path) -> None:
    target = fastdeploy_checkout(tmp_path)
    target.chmod(0o640)
    assert rls("fastdeploy", "patch", str(target)).returncode == 0
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
        "                if ready_engine_signals:\n                    logger.info",
        "                if ready_engine_signals is not None:\n                    logger.info",
    )
    assert other != text
    messager_file.write_text(other)
    done = rls("fastdeploy", "patch", str(messager_file))
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith(f"rls: error: {messager_file}: CacheMessagerV1.consume_signals (def at line ")
    changed = line_of(other, "if ready_engine_signals is not")
    assert f"release/2.6 with PR 7872: line {changed}: `if ready_engine_signals is not None:`" in done.stderr
    assert (
        f"release/2.6 after PR 8035: line {line_of(other, 'if engine_idx in self.idx')}:" in done.stderr
        and "nothing written" in done.stderr
    )
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1
    assert messager_file.read_text() == other
    assert not messager_file.with_name("cache_messager.py.orig").exists()
    assert rls("fastdeploy", "patch", str(messager_file), "--check").returncode == 2


def patch_without(modules: tuple[str, ...], *args: str) -> subprocess.CompletedProcess[str]:
    """``rls fastdeploy patch ARGS`` in a Python where ``modules`` cannot be imported."""
    hide = "; ".join(f"sys.modules[{name!r}] = None" for name in modules)
    code = f"import sys; {hide}; from redis_layer_signals.cli import main; main(sys.argv[1:])"
    environment = {k: v for k, v in os.environ.items() if not k.startswith("RLS_")}
    return subprocess.run(
        [sys.executable, "-c", code, "fastdeploy", "patch", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=environment,
    )


@pytest.mark.parametrize("missing", [("libcst",), ("libcst", "numpy")], ids=["libcst", "base-install"])
def test_without_the_extra_check_exits_3_not_1_with_an_install_hint_that_works_today(
    messager_file: Path, missing: tuple[str, ...]
) -> None:
    """The base install lacks numpy as well as libcst: both must exit 3 (cannot run), never 1
    (--check's "needs patching"), and name an install that works before any release."""
    done = patch_without(missing, str(messager_file), "--check")
    assert done.returncode == 3, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("rls: error: "), done.stderr
    assert "fastdeploy extra" in lines[0] and install_hint("fastdeploy") in lines[0], done.stderr
    assert "pip install 'redis-layer-signals[" not in done.stderr  # not on any index yet
    assert done.stdout == "" and messager_file.read_bytes() == ORIGINAL


def test_the_help_states_every_exit_code(rls: Callable[..., Done]) -> None:
    done = rls("fastdeploy", "patch", "--help")
    text = " ".join(done.stdout.replace("│", " ").split())
    for code in ("0 patched or already patched", "1 --check found work to do", "2 the file's structure"):
        assert code in text, code
    assert "3 a file could not be read or written, or the fastdeploy extra is missing" in text


# -- files the command cannot read or write: exit 3, one line, nothing changed ----------------


def unreadable(tmp_path: Path, data: bytes) -> Path:
    target = tmp_path / "cache_messager.py"
    target.write_bytes(data)
    return target


@pytest.mark.parametrize(
    ("make", "message"),
    [
        pytest.param(lambda d: unreadable(d, PNG), f"line {line_of(PNG, NUL)}: a NUL byte", id="binary"),
        pytest.param(
            lambda d: unreadable(d, ORIGINAL.replace(b"import queue\n", b"import queue  # caf\xe9\n")),
            f"line {line_of(ORIGINAL, 'import queue')}: byte 0xe9 is not utf-8",
            id="latin-1-without-cookie",
        ),
        pytest.param(
            lambda d: unreadable(d, b"#!/usr/bin/env python\n\xff\xfe\n" + ORIGINAL),
            "not a Python source file",
            id="not-utf-8-in-the-first-lines",
        ),
        pytest.param(
            lambda d: unreadable(d, ORIGINAL.replace(b"# per slot: its task", b"# per slot:\x00 its task")),
            f"line {line_of(ORIGINAL, '# per slot: its task')}: a NUL byte",
            id="nul-in-a-comment",
        ),
        pytest.param(lambda d: d, "is a directory", id="directory"),
        pytest.param(lambda d: d / "missing.py", "cannot read: No such file or directory", id="missing"),
        pytest.param(
            lambda d: (d / "loop.py").symlink_to(d / "loop.py") or d / "loop.py", "cannot read", id="symlink-loop"
        ),
    ],
)
def test_a_file_that_cannot_be_read_exits_3_in_one_line(
    rls: Callable[..., Done], tmp_path: Path, make: Callable[[Path], Path], message: str
) -> None:
    target = make(tmp_path)
    before = sorted(tmp_path.iterdir())
    for extra in ((), ("--check",)):
        done = rls("fastdeploy", "patch", str(target), *extra)
        assert done.returncode == 3, done.stdout + done.stderr
        assert done.stderr.startswith("rls: error: ") and done.stderr.count("\n") == 1, done.stderr
        assert message in done.stderr and "Traceback" not in done.stderr
        assert sorted(tmp_path.iterdir()) == before


def test_a_file_it_may_not_read_exits_3(
    rls: Callable[..., Done], messager_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(self: Path) -> bytes:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_bytes", refuse)  # the tests run as root: chmod 000 would not stop them
    done = rls("fastdeploy", "patch", str(messager_file), "--check")
    assert done.returncode == 3 and "cannot read: Permission denied" in done.stderr


@pytest.mark.parametrize(
    "tail",
    [
        pytest.param("X = " + "-" * 3000 + "1\n", id="unary-chain"),
        pytest.param("X = " + "+".join(["1"] * 800) + "\n", id="binary-chain"),
        pytest.param("X = a" + ".b" * 800 + "\n", id="attribute-chain"),
        pytest.param("X = " + "(" * 5000 + "1" + ")" * 5000 + "\n", id="parentheses"),
    ],
)
def test_a_deeply_nested_expression_is_refused_with_exit_2_not_a_crash(
    rls: Callable[..., Done], messager_file: Path, tail: str
) -> None:
    messager_file.write_bytes(ORIGINAL + tail.encode())
    done = rls("fastdeploy", "patch", str(messager_file))
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert "nested" in done.stderr or "too many nested parentheses" in done.stderr
    assert f"module: line {len(ORIGINAL.splitlines()) + 1}: " in done.stderr
    assert messager_file.read_bytes() == ORIGINAL + tail.encode()


def test_a_nesting_python_parses_but_libcst_would_not_is_refused_naming_the_line() -> None:
    with pytest.raises(StructureMismatch, match=f"line {len(ORIGINAL.splitlines()) + 1}: nested more than 100 deep"):
        patch_source(ORIGINAL + ("X = " + "+".join(["1"] * 400) + "\n").encode())


def test_a_read_only_file_is_left_alone_unless_forced(rls: Callable[..., Done], messager_file: Path) -> None:
    messager_file.chmod(0o444)
    done = rls("fastdeploy", "patch", str(messager_file))
    assert done.returncode == 3 and "read-only; give --force" in done.stderr
    assert messager_file.read_bytes() == ORIGINAL and list(messager_file.parent.iterdir()) == [messager_file]

    forced = rls("fastdeploy", "patch", str(messager_file), "--force")
    assert forced.returncode == 0, forced.stderr
    assert messager_file.read_text() == patched_text()
    assert messager_file.stat().st_mode & 0o777 == 0o444


def test_a_symlink_is_followed_the_target_patched_and_the_link_kept(
    tmp_path: Path, capsysbinary: pytest.CaptureFixture[bytes]
) -> None:
    target = fastdeploy_checkout(tmp_path)
    link = tmp_path / "link.py"
    link.symlink_to(target)
    for argv, code in ((["--check"], 1), ([], 0)):
        with pytest.raises(SystemExit) as exited:
            cli.main(["fastdeploy", "patch", str(link), *argv])
        assert exited.value.code == code
    checked = capsysbinary.readouterr().out.decode()
    # The diff is the target's, from its FastDeploy root; the link itself is left a link.
    assert checked.startswith("--- a/fastdeploy/cache_manager/cache_messager.py\n")
    assert f"{link} -> {target}: patched\noriginal kept as {target}.orig" in checked
    assert link.is_symlink() and link.readlink() == target
    assert target.read_text() == patched_text()
    assert target.with_name("cache_messager.py.orig").read_bytes() == ORIGINAL
    assert sorted(p.name for p in tmp_path.iterdir()) == ["FastDeploy", "link.py"]


@pytest.mark.parametrize("failing", ["cache_messager.py", "cache_messager.py.orig"])
def test_a_failed_rename_leaves_no_stray_file(
    rls: Callable[..., Done], messager_file: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    replace = os.replace

    def fail_on(source: Any, destination: Any) -> None:
        if Path(destination).name == failing:
            raise OSError(28, "No space left on device")
        replace(source, destination)

    monkeypatch.setattr(os, "replace", fail_on)
    done = rls("fastdeploy", "patch", str(messager_file))
    assert done.returncode == 3, done.stdout + done.stderr
    assert "cannot write: No space left on device; nothing changed" in done.stderr
    assert messager_file.read_bytes() == ORIGINAL
    assert list(messager_file.parent.iterdir()) == [messager_file]


def test_a_backup_holding_another_file_is_kept_unless_forced(rls: Callable[..., Done], messager_file: Path) -> None:
    backup = messager_file.with_name("cache_messager.py.orig")
    backup.write_bytes(b"# someone's own copy\n")
    done = rls("fastdeploy", "patch", str(messager_file))
    assert done.returncode == 3 and "holds another file" in done.stderr
    assert backup.read_bytes() == b"# someone's own copy\n" and messager_file.read_bytes() == ORIGINAL
    assert rls("fastdeploy", "patch", str(messager_file), "--force").returncode == 0
    assert backup.read_bytes() == ORIGINAL


def latin_1(text: bytes) -> bytes:
    return b"# -*- coding: latin-1 -*-\n" + text.replace(b"import queue\n", b"import queue  # caf\xe9\n")


def bom(text: bytes) -> bytes:
    return b"\xef\xbb\xbf" + text.replace(b"import queue\n", "import queue  # café\n".encode())


def crlf(text: bytes) -> bytes:
    return text.replace(b"\n", b"\r\n")


@pytest.mark.parametrize(
    ("dress", "encoding"),
    [
        pytest.param(latin_1, "iso-8859-1", id="coding-cookie"),
        pytest.param(bom, "utf-8-sig", id="bom"),
        pytest.param(crlf, "utf-8", id="crlf"),
    ],
)
def test_the_file_s_encoding_and_line_endings_are_kept_in_the_file_and_in_the_diff(
    rls: Callable[..., Done], tmp_path: Path, dress: Callable[[bytes], bytes], encoding: str
) -> None:
    source = dress(ORIGINAL)
    result = patch_source(source)
    assert result.encoding == encoding
    # The lines the codemod inserts are ASCII: the patched file is the patched fixture, dressed alike.
    assert result.patched == dress(patch_source(ORIGINAL).patched)
    target = fastdeploy_checkout(tmp_path, source)
    diff = result.diff("fastdeploy/cache_manager/cache_messager.py")
    apply_with_patch_program(diff, tmp_path / "FastDeploy", target, result.patched)
    target.write_bytes(source)
    assert rls("fastdeploy", "patch", str(target)).returncode == 0
    assert target.read_bytes() == result.patched


# -- what the codemod changes, and what it keeps ------------------------------------------------


def changed_lines(original: bytes) -> tuple[list[str], list[str]]:
    before, after = original.decode().splitlines(), patch_source(original).patched.decode().splitlines()
    removed: list[str] = []
    added: list[str] = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=before, b=after, autojunk=False).get_opcodes():
        if tag in ("replace", "delete"):
            removed += before[i1:i2]
        if tag in ("replace", "insert"):
            added += after[j1:j2]
    return removed, added


@pytest.mark.parametrize(("original", "count"), [(ORIGINAL, 33), (ORIGINAL_8035, 26)], ids=["pr7872", "pr8035"])
def test_only_the_guide_s_lines_change_every_other_byte_stays(original: bytes, count: int) -> None:
    removed, added = changed_lines(original)
    inserted = [*patch.IMPORTS, patch.BRIDGE, patch.ON_KV_SIGNAL, patch.ON_CACHE_TASK, patch.ON_TASK_FINISHED]
    assert sorted(line.strip() for line in added) == sorted(
        line.strip() for block in inserted for line in block.splitlines()
    )
    assert {line.strip() for line in removed} >= {
        "self.pending_layer0_signals = {}",
        "self.pending_layer0_signal_lock = threading.Lock()",
        "pending_engine_signals = []",
        "if layer_id == 0:",
        "if recovered_signal is not None:",
        "_, prefilled_token_num = recovered_signal",
        "recovered_signal_batch = [recovered_signal]",
        "self.cache_prefilled_engine_ids_queue.put(recovered_signal_batch)",
        "for engine_idx, prefilled_token_num in pending_engine_signals:",
        "self.pending_layer0_signals[engine_idx] = (engine_idx, prefilled_token_num)",
        "self.pending_layer0_signals.pop(current_id, None)",
    }
    assert len(removed) == count
    # Every removed line was about the pending dict, its lock, the two lists or their logs (a log
    # call spanning lines ends in a line of its own).
    words = ("pending_layer0_signal", "engine_signals", "recovered_signal", "layer_id == 0", "logger.", "else:", "if ")
    logs = ('"', 'f"', ")")
    assert all(any(w in line for w in words) or line.strip().startswith(logs) for line in removed), removed
    # The older class and the module around the imports are byte for byte as they were.
    patched = patch_source(original).patched.decode()
    older = original.decode().split("class CacheMessager:")[1].split("class CacheMessagerV1:")[0]
    assert older in patched
    assert patched.endswith(original.decode().split('logger.error(f"consumer: {e}")')[1])


def test_both_releases_patch_to_the_same_class() -> None:
    """After the patch the bridge decides for every layer-0 entry: the two releases' fixes both go."""
    fixed = patch_source(ORIGINAL).patched.decode().split("class CacheMessagerV1:")[1]
    assert patch_source(ORIGINAL_8035).patched.decode().split("class CacheMessagerV1:")[1] == fixed


def test_the_bridge_is_built_after_the_queue_and_before_the_threads_start() -> None:
    text = patched_text().split("class CacheMessagerV1:")[1]
    queue_at = text.index("self.cache_prefilled_engine_ids_queue = queue.Queue()")
    bridge_at = text.index("self.layer0 = bridge_for_messager(")
    threads_at = text.index("threading.Thread(target=self.consume_signals")
    assert queue_at < bridge_at < threads_at
    assert "ready=lambda: self.cache_prefilled_engine_ids_queue,\n" in text and "logger=logger,\n" in text


@BOTH
def test_patching_the_patched_file_changes_nothing(original: bytes) -> None:
    once = patch_source(original)
    twice = patch_source(once.patched)
    assert once.changed and not twice.changed
    assert twice.diff("x") == b""


def variant(old: str, new: str, original: bytes = ORIGINAL) -> bytes:
    text = original.decode()
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
            "release/2.6 with PR 7872: no `ready_engine_signals = []`",
            id="lists",
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
        pytest.param(
            variant(
                "                            pending_engine_signals.append((engine_idx, prefilled_token_num))\n",
                "                            pending_engine_signals.append((engine_idx, 0))\n",
                ORIGINAL_8035,
            ),
            "CacheMessagerV1.consume_signals",
            f"; release/2.6 after PR 8035: line {line_of(ORIGINAL_8035, 'pending_engine_signals.append')}: "
            "`pending_engine_signals.append((engine_idx, 0))` where `pending_engine_signals.append(",
            id="a-third-release",
        ),
        pytest.param(
            variant(
                "_, prefilled_token_num = recovered_signal\n                        if prefilled_token_num <=",
                "if recovered_signal[1] <=",
            ),
            "CacheMessagerV1._add_cache_task_thread",
            '`if recovered_signal[1] <= current_info["need_prefill_tokens"]:` where '
            "`_, prefilled_token_num = recovered_signal` is expected",
            id="adder-indexes-the-signal",
        ),
        pytest.param(
            variant("if layer_id == 0:\n", "if layer_id == 0:  # only the first\n") + b"\x0c\n",
            "",
            "",
            id="comments-and-form-feeds-do-not-count",
        ),
    ],
)
def test_a_file_the_codemod_does_not_know_is_refused_naming_the_first_place(
    source: bytes, place: str, problem: str
) -> None:
    if not place:
        assert patch_source(source).changed
        return
    with pytest.raises(StructureMismatch) as refused:
        patch_source(source)
    assert refused.value.place.startswith(place)
    assert problem in str(refused.value)


RECOVERED = "                            self.cache_prefilled_engine_ids_queue.put(recovered_signal_batch)\n"
UNPACKED = "                        _, prefilled_token_num = recovered_signal\n"
DROPPED = '                            logger.info(f"early signal {recovered_signal} exceeds its task, dropped")\n'
STORED = "                                self.pending_layer0_signals[engine_idx] = (engine_idx, prefilled_token_num)\n"
SENDER_POP = "                                    self.pending_layer0_signals.pop(current_id, None)\n"
PENDING_LOG = '                    logger.debug(f"early signals kept: {pending_engine_signals}")\n'
READY_LIST = "                ready_engine_signals = []\n"
INIT_DICT = "        self.pending_layer0_signals = {}\n"


@BOTH
@pytest.mark.parametrize(
    ("after", "added"),
    [
        pytest.param(RECOVERED, "finished_add_cache_task_req_ids.append(current_id)", id="req-ids-append"),
        pytest.param(RECOVERED, "self.recovered_ids.append(current_id)", id="self-append"),
        pytest.param(RECOVERED, "assert recovered_signal[0] == current_id", id="assert"),
        pytest.param(DROPPED, "return", id="return"),
        pytest.param(DROPPED, 'raise RuntimeError("early signal exceeds its task")', id="raise"),
        pytest.param(STORED, "self.seen.append(engine_idx)", id="in-the-store-loop"),
        pytest.param(UNPACKED, "prefilled_token_num -= 1", id="after-the-unpack"),
        pytest.param(SENDER_POP, "self.released.add(current_id)", id="in-the-sender-pop"),
        pytest.param(PENDING_LOG, "self.metrics.early(len(pending_engine_signals))", id="after-a-log-line"),
        pytest.param(
            DROPPED, 'logger.info(f"dropped {self.pending_layer0_signals.pop(current_id)}")', id="a-log-line-that-calls"
        ),
    ],
)
def test_a_statement_the_release_does_not_have_in_a_removed_block_is_refused_naming_its_line(
    rls: Callable[..., Done], messager_file: Path, original: bytes, after: str, added: str
) -> None:
    indent = after[: len(after) - len(after.lstrip())]
    source = variant(after, f"{after}{indent}{added}\n", original)
    line = line_of(source, added)
    with pytest.raises(StructureMismatch, match=f"line {line}: `{re.escape(added)}`"):
        patch_source(source)
    messager_file.write_bytes(source)
    done = rls("fastdeploy", "patch", str(messager_file))
    assert done.returncode == 2 and f"line {line}: `{added}`" in done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert messager_file.read_bytes() == source and list(messager_file.parent.iterdir()) == [messager_file]


@pytest.mark.parametrize(
    ("old", "new", "original"),
    [
        pytest.param(READY_LIST, READY_LIST + "                signal_count = 0\n", ORIGINAL, id="between-the-lists"),
        pytest.param(INIT_DICT, INIT_DICT + "        self.pending_limit = 64\n", ORIGINAL, id="init-pr7872"),
        pytest.param(INIT_DICT, INIT_DICT + "        self.pending_limit = 64\n", ORIGINAL_8035, id="init-pr8035"),
    ],
)
def test_a_statement_inside_a_removed_run_is_refused_too(old: str, new: str, original: bytes) -> None:
    source = variant(old, new, original)
    added = new.removeprefix(old).strip()
    with pytest.raises(StructureMismatch, match=f"line {line_of(source, added)}: `{re.escape(added)}`"):
        patch_source(source)


def test_log_lines_may_be_worded_otherwise() -> None:
    source = variant(DROPPED, '                            logger.warning("dropped %s", recovered_signal)\n')
    assert b'logger.warning("dropped %s"' not in patch_source(source).patched


def test_a_bridge_moved_after_the_threads_is_refused() -> None:
    text = patched_text()
    start = text.index("        # redis-layer-signals: early layer-0")
    end = text.index("        )\n", start) + len("        )\n")
    bridge = text[start:end]
    moved = text.replace(bridge, "").replace(
        '        logger.info("messager ready")', bridge + '        logger.info("messager ready")'
    )
    with pytest.raises(StructureMismatch, match=f"line {line_of(moved, 'self.layer0 =')}: .*between the queue"):
        patch_source(moved.encode())


def test_a_file_patched_with_another_bridge_is_refused() -> None:
    text = patched_text()
    other = text.replace("self.layer0 = bridge_for_messager(", "self.layer0 = Layer0Bridge(")
    with pytest.raises(StructureMismatch, match="is not this codemod's bridge"):
        patch_source(other.encode())


def test_an_undecodable_source_is_refused_before_parsing() -> None:
    with pytest.raises(UnreadableSource, match="line 1: a NUL byte"):
        patch_source(b"\x00")


# -- the patched messager runs: its hooks reach the bridge, in the guide's order ------------------


class Stop(BaseException):
    """Ends a messager loop (its `except Exception` does not catch it)."""


class StubBridge:
    """Records each hook call with what the messager held at that moment."""

    def __init__(self, **options: Any) -> None:
        self.options = options
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


def bridge_for_messager(
    *,
    splitwise_role: str,
    pod_ip: str,
    engine_worker_queue_port: int,
    rank: int,
    nranks: int,
    block_size: int,
    num_layers: int,
    ready: Callable[[], Any],
    logger: Any,
) -> StubBridge:
    """The factory's signature; a bridge whatever the role (the stubs run the prefill threads by hand)."""
    return StubBridge(
        splitwise_role=splitwise_role,
        pod_ip=pod_ip,
        engine_worker_queue_port=engine_worker_queue_port,
        rank=rank,
        nranks=nranks,
        block_size=block_size,
        num_layers=num_layers,
        ready=ready,
        logger=logger,
    )


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
    # The factory may not be in the package yet: the patched file imports whatever stands there.
    monkeypatch.setattr(redis_layer_signals.fastdeploy, "bridge_for_messager", bridge_for_messager, raising=False)
    EVENTS.clear()


@BOTH
def test_the_patched_messager_calls_the_bridge_at_the_three_hook_points(
    monkeypatch: pytest.MonkeyPatch, original: bytes
) -> None:
    # layer 0 then layer 1 of slot 5, 128 tokens in one chunk
    signals = [[1, 0, 5, 0, 128], [1, 1, 5, 0, 128]]
    stub_modules(monkeypatch, signals)
    namespace: dict[str, Any] = {"__name__": "patched_messager"}
    exec(compile(patch_source(original).patched, "cache_messager.py", "exec"), namespace)
    messager = namespace["CacheMessagerV1"]("mixed", "10.0.0.7", 9923, 1, 0, 2, num_layers=4)
    bridge = messager.layer0
    bridge.messager = messager
    options = {k: v for k, v in bridge.options.items() if k not in ("ready", "logger")}
    assert options == {
        "splitwise_role": "mixed",
        "pod_ip": "10.0.0.7",
        "engine_worker_queue_port": 9923,
        "rank": 2,  # the messager's rank_id: rank + local_data_parallel_id * nranks
        "nranks": 2,
        "block_size": 64,
        "num_layers": 4,
    }
    assert bridge.options["logger"] is namespace["logger"]
    assert not hasattr(messager, "pending_layer0_signals") and not hasattr(messager, "pending_layer0_signal_lock")

    # The bridge follows the attribute: a queue put in place later is the one it queues on.
    assert bridge.options["ready"]() is messager.cache_prefilled_engine_ids_queue
    replaced = OneBatchQueue([(5, 128)])
    messager.cache_prefilled_engine_ids_queue = replaced
    assert bridge.options["ready"]() is replaced

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


@BOTH
def test_the_unpatched_fixture_runs_too_so_the_stubs_fit_its_structure(
    monkeypatch: pytest.MonkeyPatch, original: bytes
) -> None:
    """The same stubs drive the fixture before the patch: its own dict hands the early signal over."""
    stub_modules(monkeypatch, [[1, 0, 5, 0, 128]])
    namespace: dict[str, Any] = {"__name__": "fixture_messager"}
    exec(compile(original, "cache_messager.py", "exec"), namespace)
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
