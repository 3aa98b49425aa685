"""Staged writes: a file's path holds either its complete old content or its complete new content, never a part.

Every output pyperm writes (checkpoints and their shards, index files, copied model files, reports,
curve files, plots) goes through here:

1. the content is written to a hidden staging file beside the destination (same folder, so the same
   filesystem), created exclusively and without following a symlink (``O_CREAT | O_EXCL |
   O_NOFOLLOW``), under a name no one can plant a link at in advance (it holds the process id and
   random bytes);
2. the staging file is flushed and fsynced;
3. it is renamed over the destination (``os.replace``: atomic, and a symlink at the destination is
   replaced itself, its target left alone), and the folder is fsynced so that the rename survives
   a power cut.

A process killed in between leaves at most a hidden ``.<name>.<pid>-<host>-<random>.pyperm-partial``
file; the next write into that folder removes those of processes that no longer run. A process id
means something only on its machine and in its PID namespace (``<host>`` names both: a hash of the
host name, the boot id and the namespace), so files of other machines (a shared filesystem, as
ranks on several nodes write to) or other containers are left alone, whatever their process ids
look like here: the next write from there removes them. No torch here: the reports of the solver
benchmarks use it too.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import secrets
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

__all__ = ["Staged", "fsync_folder", "remove", "remove_leftovers", "stage", "staged_files", "write_bytes", "write_file", "write_text"]

SUFFIX = ".pyperm-partial"


@functools.lru_cache(maxsize=1)
def _host() -> str:
    """Where this process's id means something: its machine (name, boot) and PID namespace, hashed."""
    parts = [socket.gethostname()]
    with contextlib.suppress(OSError):
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
    with contextlib.suppress(OSError):
        parts.append(str(os.stat("/proc/self/ns/pid").st_ino))
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:12]


def _staging_name(final: Path) -> Path:
    return final.with_name(f".{final.name}.{os.getpid()}-{_host()}-{secrets.token_hex(6)}{SUFFIX}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_leftovers(folder: Path) -> None:
    """Remove the staging files a killed pyperm process of this machine and PID namespace left in ``folder``
    (never those of a running one, which may be writing there now, nor those of another machine or
    namespace, whose process ids cannot be checked from here)."""
    try:
        entries = list(os.scandir(folder))
    except OSError:  # no such folder yet: nothing left over
        return
    for entry in entries:
        name = entry.name
        if not (name.startswith(".") and name.endswith(SUFFIX)):
            continue
        owner = name[: -len(SUFFIX)].rsplit(".", 1)[-1].split("-")
        if len(owner) != 3 or owner[1] != _host() or not owner[0].isdigit():
            continue  # another machine's or namespace's (or an older pyperm's, which did not say where)
        if int(owner[0]) != os.getpid() and not _alive(int(owner[0])):
            with contextlib.suppress(OSError):  # a symlink is removed itself, not its target
                os.unlink(entry.path)


def fsync_folder(folder: Path) -> None:
    """Make the renames in ``folder`` durable (POSIX: the folder's entries are its content)."""
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class Staged:
    """A complete, fsynced staging file, not yet at its final name."""

    tmp: Path
    final: Path

    def commit(self) -> Path:
        """Rename the staging file over the final name (atomic; a symlink there is replaced, not followed)."""
        os.replace(self.tmp, self.final)
        return self.final

    def discard(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.tmp)


def stage(final: Path, write: Callable[[BinaryIO], object]) -> Staged:
    """Write a staging file for ``final`` with ``write(file)`` (a binary file open for writing), and fsync it.

    The staging file is created exclusively and never through a symlink; if ``write`` raises, it
    is removed and the exception propagates.
    """
    final = Path(final)
    tmp = _staging_name(final)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(tmp, flags, 0o666)  # the umask applies, as for any new file
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return Staged(tmp, final)


def write_file(final: Path, write: Callable[[BinaryIO], object]) -> Path:
    """Write ``final`` through a staging file (:func:`stage`), rename it into place, fsync the folder."""
    final = Path(final)
    remove_leftovers(final.parent)
    path = stage(final, write).commit()
    fsync_folder(final.parent)
    return path


def write_bytes(final: Path, data: bytes) -> Path:
    """:func:`write_file` of ``data``."""
    return write_file(final, lambda f: f.write(data))


def write_text(final: Path, text: str) -> Path:
    """:func:`write_file` of ``text`` in UTF-8."""
    return write_bytes(final, text.encode("utf-8"))


@contextlib.contextmanager
def staged_files() -> Iterator[list[Staged]]:
    """Collect staging files; if the block raises, every one is removed (none reached its final name)."""
    staged: list[Staged] = []
    try:
        yield staged
    except BaseException:
        for s in staged:
            s.discard()
        raise


def remove(path: Path) -> None:
    """Remove a file that a committed write made obsolete (a missing one is fine; a symlink goes, not its
    target)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
