# SPDX-License-Identifier: Apache-2.0
"""The node cache's shared memory: one file per owner generation in a private folder.

The folder (:func:`default_dir`, or ``node_cache_dir``) belongs to the user and has mode 0700;
every file in it has mode 0600. It holds:

- ``owner.lock``: locked (``flock``) by the running owner for its whole life, so one folder has
  at most one owner.
- ``node.sock``: the owner's Unix socket.
- ``arena-<generation>.bin``: the arena, a :data:`HEADER_BYTES` header (magic, generation, data
  size) followed by the chunk bytes. Each owner start picks a new random generation, removes the
  files of previous generations and reserves the whole file (``posix_fallocate``), so a folder
  on a too small tmpfs fails at start with a clear error instead of a ``SIGBUS`` later.
- ``owner.log``: what an owner started by an engine writes.

Engines map the arena file named in the owner's welcome (:func:`map_arena`) and check its header:
a mapping of a previous owner's file is never taken for the current one.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
import stat
import struct
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from lmcache.devices import DeviceBackend

__all__ = [
    "HEADER_BYTES",
    "MAGIC",
    "ArenaFile",
    "MappedArena",
    "NodeCacheError",
    "create_arena",
    "default_dir",
    "ensure_private_dir",
    "map_arena",
    "pin_in_background",
    "private_file",
    "remove_stale_arenas",
    "unpin",
]

logger = logging.getLogger("lmcache.node.client")

HEADER_BYTES = 4096
"""Bytes before the chunk data (one page, so chunk data starts page-aligned)."""

MAGIC = b"LMCNODE1"
_HEAD = struct.Struct("<8s32sQ")  # magic, generation (ASCII, zero-padded), data bytes
SOCKET_NAME = "node.sock"
LOCK_NAME = "owner.lock"
LOG_NAME = "owner.log"
_MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes with the terminating zero


class NodeCacheError(RuntimeError):
    """A node cache folder or arena that cannot be used (says what, expected, found, fix)."""


def default_dir() -> Path:
    """The default node cache folder: ``/dev/shm/lmcache-<uid>`` where ``/dev/shm`` exists,
    else ``$XDG_RUNTIME_DIR/lmcache``, else ``<tmp>/lmcache-<uid>``.

    ``/dev/shm`` comes first because the arena is memory: ``XDG_RUNTIME_DIR`` is usually a tmpfs
    capped at 10 % of RAM, too small for a node's host cache.
    """
    uid = os.getuid()
    if os.path.isdir("/dev/shm"):
        return Path(f"/dev/shm/lmcache-{uid}")
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return Path(runtime) / "lmcache"
    return Path(tempfile.gettempdir()) / f"lmcache-{uid}"


def ensure_private_dir(path: str | os.PathLike[str]) -> Path:
    """Create ``path`` with mode 0700 if needed and check that only this user can enter it.

    Raises:
        NodeCacheError: ``path`` is not a folder, belongs to another user, is reachable by
            others, or its socket path would be too long for a Unix socket.
    """
    folder = Path(path)
    sock = str(folder / SOCKET_NAME)
    if len(os.fsencode(sock)) > _MAX_SOCKET_PATH:
        raise NodeCacheError(
            f"node cache folder {str(folder)!r}: expected a path short enough for a Unix socket "
            f"(at most {_MAX_SOCKET_PATH} bytes for {sock!r}), found {len(os.fsencode(sock))}. "
            "Set node_cache_dir to a shorter path."
        )
    with contextlib.suppress(FileExistsError):
        folder.mkdir(mode=0o700, parents=True)
    try:
        info = os.lstat(folder)
    except OSError as exc:
        raise NodeCacheError(f"node cache folder {str(folder)!r} cannot be read: {exc}") from exc
    if not stat.S_ISDIR(info.st_mode):
        raise NodeCacheError(
            f"node cache folder {str(folder)!r}: expected a folder, found another kind of file "
            "(or a symbolic link). Remove it or set node_cache_dir elsewhere."
        )
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise NodeCacheError(
            f"node cache folder {str(folder)!r}: expected a folder of uid {os.getuid()} with "
            f"mode 0700, found uid {info.st_uid} and mode {stat.S_IMODE(info.st_mode):04o}. "
            "Another user may reach the cache through it: remove it, or set node_cache_dir to "
            "a folder of your own (it is created with mode 0700)."
        )
    return folder


def private_file(path: Path, flags: int) -> int:
    """``os.open`` of ``path`` with mode 0600 (``O_NOFOLLOW``; created if ``O_CREAT``)."""
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


@dataclass(frozen=True)
class ArenaFile:
    """An arena file an owner created (the owner never maps it: it only hands out offsets)."""

    path: Path
    generation: str
    data_bytes: int


def create_arena(folder: Path, data_bytes: int) -> ArenaFile:
    """Create a new arena of ``data_bytes`` in ``folder`` (mode 0600, fully reserved).

    Raises:
        NodeCacheError: the folder's file system cannot hold it.
    """
    generation = secrets.token_hex(16)
    path = folder / f"arena-{generation}.bin"
    fd = private_file(path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
    try:
        total = HEADER_BYTES + int(data_bytes)
        try:
            os.posix_fallocate(fd, 0, total)
        except OSError as exc:
            raise NodeCacheError(
                f"node cache arena {str(path)!r}: expected {total} bytes of room in "
                f"{str(folder)!r}, found: {exc}. Lower max_local_cpu_size, make the file system "
                "larger (containers: --shm-size), or set node_cache_dir elsewhere."
            ) from exc
        os.pwrite(fd, _HEAD.pack(MAGIC, generation.encode(), int(data_bytes)), 0)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            path.unlink()
        raise
    os.close(fd)
    return ArenaFile(path, generation, int(data_bytes))


def remove_stale_arenas(folder: Path, keep: str = "") -> int:
    """Remove the arena files of other generations; returns how many (their memory returns to
    the system once no process maps them)."""
    removed = 0
    for path in folder.glob("arena-*.bin"):
        if keep and path.name == f"arena-{keep}.bin":
            continue
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed += 1
    return removed


@dataclass(eq=False)
class MappedArena:
    """An engine's mapping of one arena generation.

    Attributes:
        generation: The owner generation the file belongs to.
        data: ``uint8 [data_bytes]``: the chunk bytes (header excluded).
        registered: Whether :attr:`data` is page-locked with the device backend (by the thread
            :attr:`pinning`).
        live: Leases this process holds on its bytes (the mapping is dropped at 0 once stale).
    """

    generation: str
    data: torch.Tensor
    registered: bool = False
    live: int = 0
    typed: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)
    pinning: threading.Thread | None = None  # the thread page-locking it, if any

    def views(
        self, offsets: Sequence[int], shape: Sequence[int], dtype: torch.dtype
    ) -> list[torch.Tensor]:
        """The contiguous ``shape``/``dtype`` tensors at byte ``offsets`` (multiples of the
        dtype's size): one ``as_strided`` each of a cached typed view, a few microseconds."""
        import torch

        with torch.inference_mode(False):  # normal tensors even if the engine is in it
            flat = self.typed.get(dtype)
            if flat is None:
                flat = self.typed[dtype] = self.data.view(dtype)
            strides, step = [], 1
            for d in reversed(shape):
                strides.append(step)
                step *= max(int(d), 1)
            size, stride, item = tuple(shape), tuple(reversed(strides)), dtype.itemsize
            return [flat.as_strided(size, stride, offset // item) for offset in offsets]


def map_arena(path: str, generation: str, data_bytes: int) -> MappedArena:
    """Map the arena file ``path`` and check it is the generation the owner announced.

    Raises:
        NodeCacheError: the file is missing, not private to this user, or not that generation.
    """
    import torch

    fd = private_file(Path(path), os.O_RDWR)
    try:
        info = os.fstat(fd)
        if info.st_uid != os.getuid() or info.st_mode & 0o077:
            raise NodeCacheError(
                f"node cache arena {path!r}: expected a file of uid {os.getuid()} with mode "
                f"0600, found uid {info.st_uid}, mode {stat.S_IMODE(info.st_mode):04o}."
            )
        total = HEADER_BYTES + int(data_bytes)
        if info.st_size < total:
            raise NodeCacheError(
                f"node cache arena {path!r}: expected {total} bytes, found {info.st_size}."
            )
        mm = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    magic, gen, size = _HEAD.unpack_from(mm, 0)
    found = gen.rstrip(b"\0").decode("ascii", "replace")
    if magic != MAGIC or found != generation or size != data_bytes:
        mm.close()
        raise NodeCacheError(
            f"node cache arena {path!r}: expected generation {generation} of {data_bytes} "
            f"bytes, found {found} of {size} (magic {magic!r}); the owner was replaced "
            "meanwhile, the engine reconnects."
        )
    with torch.inference_mode(False):
        data = torch.frombuffer(mm, dtype=torch.uint8, count=int(data_bytes), offset=HEADER_BYTES)
    return MappedArena(generation, data)


def pin_in_background(arena: MappedArena, backend: DeviceBackend) -> None:
    """Page-lock ``arena`` with ``backend`` on a thread (:attr:`MappedArena.pinning`): pinning a
    large arena takes seconds, which a request that reconnects must not wait for (copies from it
    meanwhile are pageable, and still right). A failure leaves it pageable, with a warning."""
    if arena.data.numel() == 0:
        return

    def pin() -> None:
        try:
            arena.registered = backend.host_register(arena.data)
        except RuntimeError as exc:
            logger.warning("lmcache node cache: the arena stays pageable: %s", exc)

    arena.pinning = threading.Thread(target=pin, name="lmcache-node-pin", daemon=True)
    arena.pinning.start()


def unpin(arena: MappedArena, backend: DeviceBackend) -> None:
    """Undo :func:`pin_in_background` (waiting for it first); the caller knows no lease of
    ``arena`` remains."""
    if arena.pinning is not None:
        arena.pinning.join()
    if arena.registered:
        arena.registered = False
        try:
            backend.host_unregister(arena.data)
        except RuntimeError as exc:
            logger.warning("lmcache node cache: unpinning an old arena failed: %s", exc)
