"""The files of ``rls fastdeploy patch``: FILE read through its symlinks, the diff's paths relative
to FastDeploy's root, and every write made whole (a temporary file renamed over the old one), so
that no failure leaves a half-written file or a stray one behind.

No libcst here: the command's file handling does not depend on the codemod.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path

PACKAGE = "fastdeploy"
"""FastDeploy's package folder: the directory above it is the root ``patch -p1`` runs from."""


class FileProblem(Exception):
    """FILE, its backup or OUT could not be read or written: nothing was changed."""


def resolve(path: Path) -> Path:
    """The regular file ``path`` names, through any symlinks: the link stays a link, and what
    is read and patched is its target."""
    try:
        target = path.resolve(strict=True)
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop
        raise FileProblem(f"{path}: cannot read: {_reason(exc)}") from exc
    if target.is_dir():
        raise FileProblem(f"{path}: is a directory, not FastDeploy's cache_messager.py")
    if not target.is_file():
        raise FileProblem(f"{path}: not a regular file")
    return target


def read(target: Path) -> bytes:
    try:
        return target.read_bytes()
    except OSError as exc:
        raise FileProblem(f"{target}: cannot read: {_reason(exc)}") from exc


def fastdeploy_root(target: Path) -> Path:
    """The directory above the ``fastdeploy/`` package folder holding ``target``, else the
    file's own directory."""
    for parent in target.parents:
        if parent.name == PACKAGE:
            return parent.parent
    return target.parent


def diff_name(target: Path, root: Path | None) -> str:
    """``target`` relative to ``root`` (default: its FastDeploy root), as the diff names it;
    raises ValueError when ``root`` does not hold it."""
    base = fastdeploy_root(target) if root is None else root.resolve()
    try:
        return target.relative_to(base).as_posix()
    except ValueError:
        raise ValueError(f"--root {root} does not hold {target}") from None


def replace(target: Path, data: bytes, original: bytes, *, force: bool) -> Path:
    """Write ``data`` over ``target`` and keep ``original`` as ``target.orig`` (returned). A
    read-only target, or a backup holding another file, is refused unless ``force``. When the
    rewrite fails, a backup this call made is removed again."""
    refuse_read_only(target, force=force)
    backup = target.with_name(target.name + ".orig")
    existed, kept = os.path.lexists(backup), _holds(backup, original)
    if existed and not kept and not force:
        raise FileProblem(f"{backup}: holds another file; move it away, or give --force to replace it")
    try:
        if not kept:
            _write_whole(backup, original, mode_of=target)
        try:
            _write_whole(target, data, mode_of=target)
        except BaseException:
            if not existed:
                backup.unlink(missing_ok=True)
            raise
    except OSError as exc:
        raise FileProblem(f"{target}: cannot write: {_reason(exc)}; nothing changed") from exc
    return backup


def write_copy(output: Path, data: bytes, *, mode_of: Path, force: bool) -> Path:
    """Write ``data`` to ``output`` (through a symlink to its target), with ``mode_of``'s mode."""
    target = output.resolve()
    if target.is_dir():
        raise FileProblem(f"{output}: is a directory")
    if target.exists():
        refuse_read_only(target, force=force)
    try:
        _write_whole(target, data, mode_of=mode_of)
    except OSError as exc:
        raise FileProblem(f"{output}: cannot write: {_reason(exc)}") from exc
    return target


def refuse_read_only(path: Path, *, force: bool) -> None:
    """A read-only file says someone meant it to stay as it is: a rename would replace it all
    the same (the directory decides), so the command refuses unless told ``--force``."""
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        raise FileProblem(f"{path}: cannot read: {_reason(exc)}") from exc
    if (not mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH) or not os.access(path, os.W_OK)) and not force:
        raise FileProblem(f"{path}: read-only; give --force to replace it anyway")


def _holds(path: Path, data: bytes) -> bool:
    try:
        return path.is_file() and not path.is_symlink() and path.read_bytes() == data
    except OSError:
        return False


def _write_whole(path: Path, data: bytes, *, mode_of: Path) -> None:
    """Write ``path`` all at once (a temporary file renamed over it), with ``mode_of``'s mode:
    an interrupted run never leaves half a file, and a failed one no temporary file."""
    handle, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".rls-tmp")
    temporary = Path(name)
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(data)
        shutil.copymode(mode_of, temporary)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def _reason(exc: BaseException) -> str:
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
