# SPDX-License-Identifier: Apache-2.0
"""The disk tier's folder of chunk files: names, crash-safe writes, checked reads, the start scan.

:class:`ChunkFiles` knows how one chunk lives on disk and nothing about quotas or recency.
:class:`~lmcache.tiers.disk.tier.DiskTier` keeps the index and the LRU quota on top of it.
The layout, the write protocol and the read path are described in :mod:`lmcache.tiers.disk.tier`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import logging
import os
import re
import stat
import urllib.parse
from collections.abc import Callable

import torch

from lmcache.errors import ConfigError, CorruptChunk
from lmcache.tiers.chunk_format import HEADER_BYTES, ChunkHeader, verify_chunk
from lmcache.tiers.lower_tier import ReadRequest

__all__ = ["SUFFIX", "TMP_PREFIX", "ChunkFiles", "FileInfo", "Ident", "local_path", "make_folder"]

logger = logging.getLogger("lmcache.tiers.disk.tier")  # one logger name for the whole disk tier

#: Suffix of a chunk file; its stem is the chunk key in hex.
SUFFIX = ".lmc"
#: Prefix of a temporary file (a write in progress, or left by a crash).
TMP_PREFIX = ".tmp-"
_HEX32 = re.compile(r"[0-9a-f]{32}")
_ENTRY = re.compile(r"([0-9a-f]{32})\.lmc")
_DIRECT_ALIGN = 4096
_O_DIRECT: int = getattr(os, "O_DIRECT", 0)
_O_NOFOLLOW: int = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC: int = getattr(os, "O_CLOEXEC", 0)

Ident = tuple[bytes, bytes]
"""A chunk's identity on disk: (fingerprint digest, chunk key)."""

FileInfo = tuple[int, int, Ident | None]
"""What a checked chunk file tells: (size, mtime in ns, parent ident or ``None``)."""


def local_path(path: str) -> str:
    """``/dir``, ``~/dir`` or ``file:///dir`` as an absolute path."""
    if path.startswith("file:"):
        parsed = urllib.parse.urlparse(path)
        if parsed.netloc not in ("", "localhost") or not parsed.path:
            raise ConfigError(
                f"lmcache config key 'local_disk': expected a local folder such as '/data/lmcache' "
                f"or 'file:///data/lmcache', found {path!r}. Use a path on this machine (for a "
                "shared cache use remote_url)."
            )
        path = urllib.parse.unquote(parsed.path)
    if not path:
        raise ConfigError(
            "lmcache config key 'local_disk': found an empty path; set it to a folder such as "
            "'/data/lmcache', or unset it to run without a disk tier."
        )
    return os.path.abspath(os.path.expanduser(path))


def _bad_folder(path: str, found: str) -> ConfigError:
    return ConfigError(
        f"lmcache config key 'local_disk': cannot use {path!r} as the disk tier folder: {found}. "
        "Set local_disk to a writable folder on a local filesystem (it is created, mode 0700, "
        "if missing), or unset it to run without a disk tier."
    )


def make_folder(path: str) -> None:
    """Create ``path`` and its missing parents, each 0700; warn if an existing one is looser."""
    missing: list[str] = []
    probe = path
    while True:
        try:
            st = os.stat(probe)
        except (FileNotFoundError, NotADirectoryError):
            missing.append(probe)
            parent = os.path.dirname(probe)
            if parent == probe:
                raise _bad_folder(path, "no existing parent folder") from None
            probe = parent
            continue
        except OSError as exc:
            raise _bad_folder(path, f"{probe!r} cannot be inspected ({exc})") from exc
        if not stat.S_ISDIR(st.st_mode):
            raise _bad_folder(path, f"{probe!r} exists and is not a folder")
        break
    if not missing and st.st_mode & 0o077:
        logger.warning(
            "lmcache disk tier folder %s has mode %o: other users can list it. Its chunk files "
            "are 0600, but consider 'chmod 700 %s'.",
            path,
            stat.S_IMODE(st.st_mode),
            path,
        )
    for folder in reversed(missing):
        try:
            os.mkdir(folder, 0o700)
            os.chmod(folder, 0o700)  # the umask may have cleared bits we set; it cannot add any
        except FileExistsError:
            if not os.path.isdir(folder):
                raise _bad_folder(path, f"{folder!r} exists and is not a folder") from None
        except OSError as exc:
            raise _bad_folder(path, f"cannot create {folder!r} ({exc})") from exc


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unlink(path: str) -> None:
    """Delete ``path``; already gone is fine."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _remove_if_abandoned(path: str) -> bool:
    """Delete a temporary file whose writer is gone (its ``flock`` is free); ``True`` if gone."""
    try:
        fd = os.open(path, os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC)
    except FileNotFoundError:
        return True
    except OSError:  # a symlink (not ours to keep), or unreadable
        with contextlib.suppress(OSError):
            os.unlink(path)
        return True
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a live writer holds it
        unlink(path)
        return True
    finally:
        os.close(fd)


def _pread_into(fd: int, buf: memoryview, offset: int) -> int:
    """Read up to ``len(buf)`` bytes at ``offset`` (looping over short reads); bytes read."""
    done = 0
    total = len(buf)
    while done < total:
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


class ChunkFiles:
    """The chunk files under one folder, one subfolder per fingerprint.

    Keeps no index and takes no lock: the tier above serializes writes and clears.

    Args:
        root: The folder, absolute (see :func:`local_path`); it must exist.
        fsync: ``fsync`` each file and its folder before a write counts as done.
        direct_io: Read payloads with ``O_DIRECT`` when the destination is 4 KiB-aligned.
    """

    def __init__(self, root: str, *, fsync: bool, direct_io: bool) -> None:
        self.root = root
        self.fsync = fsync
        #: Whether aligned payloads are still read with ``O_DIRECT`` (off once refused).
        self.direct = direct_io and _O_DIRECT != 0
        self._seq = itertools.count()

    def folder(self, fingerprint: bytes) -> str:
        """The subfolder of one fingerprint."""
        return os.path.join(self.root, fingerprint.hex())

    def path(self, fingerprint: bytes, key: bytes) -> str:
        """The file of one chunk."""
        return os.path.join(self.root, fingerprint.hex(), key.hex() + SUFFIX)

    def probe_writable(self) -> None:
        """Raise :class:`ConfigError` (key ``local_disk``) when no file can be created."""
        probe = os.path.join(self.root, f".lmcache-probe-{os.getpid()}-{next(self._seq)}")
        try:
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC, 0o600))
            unlink(probe)
        except OSError as exc:
            raise _bad_folder(self.root, f"a file cannot be created in it ({exc})") from exc

    # ------------------------------------------------------------------ start scan

    def scan(self) -> tuple[list[tuple[Ident, FileInfo]], int, int]:
        """Every chunk file whose header checks, oldest first, after deleting the rest.

        Returns:
            ``(chunks, bad, stale)``: the chunks as ``(ident, (size, mtime, parent))``, the
            count of deleted files that did not check, and of abandoned temporary files.
        """
        found: list[tuple[Ident, FileInfo]] = []
        bad = stale = 0
        for folder in list(os.scandir(self.root)):
            if not (_HEX32.fullmatch(folder.name) and folder.is_dir(follow_symlinks=False)):
                continue
            fingerprint = bytes.fromhex(folder.name)
            try:
                if stat.S_IMODE(folder.stat(follow_symlinks=False).st_mode) != 0o700:
                    os.chmod(folder.path, 0o700)  # our folder: keep it private
                entries = list(os.scandir(folder.path))
            except OSError as exc:
                logger.warning("lmcache disk tier: skipping folder %s (%r)", folder.path, exc)
                continue
            for entry in entries:
                if entry.name.startswith(TMP_PREFIX):
                    stale += _remove_if_abandoned(entry.path)
                    continue
                match = _ENTRY.fullmatch(entry.name)
                if match is None:
                    continue
                ident = (fingerprint, bytes.fromhex(match.group(1)))
                try:
                    info = self.check(entry.path, ident)
                except CorruptChunk as exc:
                    logger.debug("lmcache disk tier: deleting %s at start (%s)", entry.path, exc)
                    bad += 1
                    unlink(entry.path)
                    continue
                except OSError as exc:
                    logger.warning("lmcache disk tier: skipping %s (%r)", entry.path, exc)
                    continue
                found.append((ident, info))
        found.sort(key=lambda item: item[1][1])
        return found, bad, stale

    @staticmethod
    def check(path: str, ident: Ident) -> FileInfo:
        """Size, mtime and parent (``None``: none recorded) of a chunk file whose header
        matches its name; raises CorruptChunk."""
        try:
            # O_NONBLOCK: a FIFO under a chunk name must not block the start-up scan (it is
            # no regular file: deleted below); regular files ignore the flag
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _O_NOFOLLOW | _O_CLOEXEC)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise CorruptChunk("a symlink under a chunk name") from exc
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CorruptChunk("not a regular file")
            if stat.S_IMODE(st.st_mode) & 0o077:
                with contextlib.suppress(OSError):
                    os.fchmod(fd, 0o600)
            header = ChunkHeader.decode(os.pread(fd, HEADER_BYTES, 0))
        finally:
            os.close(fd)
        if (header.fingerprint, header.key) != ident:
            raise CorruptChunk("the header names another key or fingerprint than the file name")
        layers, tokens, width = header.shape
        itemsize = torch.empty((), dtype=header.dtype).element_size()
        if header.nbytes != layers * tokens * width * itemsize:
            raise CorruptChunk("the payload length does not match the shape")
        if st.st_size != HEADER_BYTES + header.nbytes:
            raise CorruptChunk(
                f"file is {st.st_size} bytes, expected {HEADER_BYTES + header.nbytes}"
            )
        parent = None if header.parent is None else (ident[0], header.parent)
        return st.st_size, st.st_mtime_ns, parent

    # ------------------------------------------------------------------ read

    def read(self, fingerprint: bytes, request: ReadRequest) -> bool | CorruptChunk | None:
        """Read and verify one chunk into ``request.out``.

        Returns:
            ``True`` when read and verified, the :class:`CorruptChunk` when it does not
            verify, ``None`` when there is no such file.
        """
        out = request.out
        path = self.path(fingerprint, request.key)
        try:
            fd = os.open(path, os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                return CorruptChunk("a symlink under a chunk name")
            raise
        shape = (out.shape[0], out.shape[1], out.shape[2])
        try:
            head = os.pread(fd, HEADER_BYTES, 0)
            if len(head) < HEADER_BYTES:
                return CorruptChunk(f"file truncated inside the header ({len(head)} bytes)")
            header = ChunkHeader.decode(head)
            verify_chunk(
                header, None, key=request.key, fingerprint=fingerprint, shape=shape, dtype=out.dtype
            )
            size = os.fstat(fd).st_size
            if size != HEADER_BYTES + header.nbytes:
                return CorruptChunk(
                    f"file is {size} bytes, expected {HEADER_BYTES + header.nbytes}"
                )
            buf = out.reshape(-1).view(torch.uint8).numpy().data
            got = self._read_payload(fd, path, buf, out.data_ptr())
            if got != len(buf):
                return CorruptChunk(f"payload truncated: read {got} of {len(buf)} bytes")
            verify_chunk(
                header, out, key=request.key, fingerprint=fingerprint, shape=shape, dtype=out.dtype
            )
        except CorruptChunk as exc:
            return exc
        finally:
            os.close(fd)
        return True

    def _read_payload(self, fd: int, path: str, buf: memoryview, address: int) -> int:
        """Read the payload into ``buf``; ``O_DIRECT`` for its aligned part when possible."""
        bulk = len(buf) // _DIRECT_ALIGN * _DIRECT_ALIGN
        if not (self.direct and bulk and address % _DIRECT_ALIGN == 0):
            return _pread_into(fd, buf, HEADER_BYTES)
        try:
            direct = os.open(path, os.O_RDONLY | _O_DIRECT | _O_NOFOLLOW | _O_CLOEXEC)
        except FileNotFoundError:
            return _pread_into(fd, buf, HEADER_BYTES)  # replaced meanwhile: fd still reads
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self._no_direct(exc)
            return _pread_into(fd, buf, HEADER_BYTES)
        try:
            if os.fstat(direct).st_ino != os.fstat(fd).st_ino:  # replaced between the opens
                return _pread_into(fd, buf, HEADER_BYTES)
            try:
                got = _pread_into(direct, buf[:bulk], HEADER_BYTES)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._no_direct(exc)
                return _pread_into(fd, buf, HEADER_BYTES)
        finally:
            os.close(direct)
        if got != bulk:
            return got
        return bulk + _pread_into(fd, buf[bulk:], HEADER_BYTES + bulk)

    def _no_direct(self, exc: OSError) -> None:
        if self.direct:
            self.direct = False
            logger.info(
                "lmcache disk tier %s: O_DIRECT refused (%r); reading through the page cache.",
                self.root,
                exc,
            )

    # ------------------------------------------------------------------ write and clear

    def write(
        self,
        fingerprint: bytes,
        key: bytes,
        header: bytes,
        payload: memoryview,
        stamp: Callable[[], int],
    ) -> int:
        """Write ``header + payload`` to a temporary file and rename it onto the chunk's name.

        ``stamp()`` gives the file's mtime (ns), asked once the bytes are written.

        Returns:
            The mtime the file was given.
        """
        folder = self.folder(fingerprint)
        final = self.path(fingerprint, key)
        tmp = os.path.join(folder, f"{TMP_PREFIX}{key.hex()}-{os.getpid()}-{next(self._seq)}")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC
        new_folder = False
        try:
            fd = os.open(tmp, flags, 0o600)
        except FileNotFoundError:
            try:
                os.mkdir(folder, 0o700)
                os.chmod(folder, 0o700)
                new_folder = True
            except FileExistsError:
                pass
            fd = os.open(tmp, flags, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # marks the temp file as live
                parts = [memoryview(header), payload]
                while parts:
                    n = os.writev(fd, parts)
                    while parts and n >= len(parts[0]):
                        n -= len(parts[0])
                        parts.pop(0)
                    if parts and n:
                        parts[0] = parts[0][n:]
                mtime = stamp()
                os.utime(fd, ns=(mtime, mtime))
                if self.fsync:
                    os.fsync(fd)
                os.replace(tmp, final)  # while the flock is held: a start scan leaves it be
            finally:
                os.close(fd)
        except BaseException:
            with contextlib.suppress(OSError):
                unlink(tmp)
            raise
        if self.fsync:
            _fsync_dir(folder)
            if new_folder:
                _fsync_dir(self.root)
        return mtime

    def clear(self, fingerprint: bytes | None, progress: Callable[[], object]) -> None:
        """Delete the chunk files of one fingerprint (``None``: all) and abandoned temporaries.

        ``progress()`` is called after each file, so a long clear that keeps moving is not cut.
        """
        if fingerprint is not None:
            names = [fingerprint.hex()]
        else:
            names = [n for n in os.listdir(self.root) if _HEX32.fullmatch(n)]
        for name in names:
            folder = os.path.join(self.root, name)
            try:
                entries = os.listdir(folder)
            except (FileNotFoundError, NotADirectoryError):
                continue
            for entry in entries:
                if _ENTRY.fullmatch(entry):
                    unlink(os.path.join(folder, entry))
                    progress()
                elif entry.startswith(TMP_PREFIX):
                    _remove_if_abandoned(os.path.join(folder, entry))
            with contextlib.suppress(OSError):  # other files, or a write creating one
                os.rmdir(folder)
