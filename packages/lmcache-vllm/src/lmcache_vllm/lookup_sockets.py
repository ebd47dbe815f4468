# SPDX-License-Identifier: Apache-2.0
"""Scheduler -> worker cache lookups over Unix-domain sockets.

vLLM asks the *scheduler-side* connector how many leading prompt tokens the external cache holds,
but the cache lives with the *workers* (one shard per tensor-parallel rank, possibly in other
processes). The lifecycle:

1. Each worker rank starts a :class:`LookupServer` once its KV caches are registered. The server
   binds :func:`socket_path` ``(engine_key, rank)`` and answers from a daemon thread, one thread per
   connection, so one slow or stuck peer never blocks another.
2. The scheduler's :class:`LookupClient` keeps persistent connections per rank (one for each
   lookup in flight at once: lookups from several threads never wait for each other). A lookup
   sends the :class:`LookupQuery` to *every* rank at once, then collects the replies until *one*
   overall deadline (``timeout_s`` from the start of the call). The answer is the minimum over
   the ranks: a token counts only when every rank holds its shard. The worker leases the hit chunks
   under ``req_id`` when it answers, so the load that follows finds them. The same lookup asked
   again (vLLM asks at every step while the request waits) is sent as its request id and
   digest, not its token ids; a server that no longer remembers it asks for it whole
   (:mod:`lmcache_vllm.scheduler.sent_lookups`). A rank whose server lives
   in the client's own process (vLLM's scheduler and a single worker share the engine-core
   process) is called directly: same answer, no socket round trip; when every rank is, no frame
   is packed either (the query's limits are checked, its token ids where their keys are made).
   With ``direct_deadline`` such a call runs on a daemon thread and is waited for until the
   same deadline: a worker stuck in a lookup is a miss, never a stuck caller (and after
   repeated timeouts the client backs off, asking nothing for a while, one log line).
3. :meth:`LookupClient.clear` asks every rank to empty its cache (``reset_prefix_cache``).
4. :meth:`LookupServer.close` stops serving and removes the socket file, but only if the file at
   the path is still the one it bound (a newer server may have replaced it).

Failures are misses, never errors. :meth:`LookupClient.lookup` never raises: a query that cannot
be encoded (a limit of the wire format exceeded, a token id outside ``[0, 2**32)``), a rank whose
socket is missing (not up yet, or gone), refused, closed, slow past the deadline, answering
garbage or answering ``-1`` all make the lookup return 0. Each such rank answer is counted in
:attr:`LookupClient.failures` and logged once per change of that rank's state, not once per call.
A missing socket is a miss at once (no waiting loop); the next call connects again. A rank that
misses the deadline has its connection closed, so its late reply can never be read as the answer
to a later request.

Where: ``<base>/lmcache-vllm-<uid>-<sha256(engine_key)[:16]>/rank<r>.sock``, with ``base``
defaulting to :func:`tempfile.gettempdir`. The engine key (:func:`engine_key`) names one engine
instance: the scheduler and the workers of one engine share it, two engines (in one process or on
one host) never do. The folder is ``0700``
and owned by this user (a server refuses any other folder; a client does not connect through
one); the socket is ``0600``. The digest keeps the path under the ~108-byte ``AF_UNIX`` limit.

Wire format: :mod:`lmcache_vllm.lookup_wire` (little-endian :mod:`struct` framing, no pickle;
every limit checked on both sides).
The server is :mod:`lmcache_vllm.worker.lookup_server`, the client
:mod:`lmcache_vllm.scheduler.lookup_client`.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lmcache_vllm.vllm_types import VllmConfig

__all__ = [
    "LOG_EVERY_S",
    "LogThrottle",
    "engine_key",
    "socket_dir",
    "socket_path",
    "unsafe_folder",
]

SUN_PATH_MAX = 107  # sizeof(sockaddr_un.sun_path) - 1 on Linux
LOG_EVERY_S = 60.0
"""Repeated errors of one kind that have no per-rank state are logged at most this often."""


def engine_key(vllm_config: VllmConfig) -> str:
    """Names one engine instance: ``kv_transfer_config.engine_id``, ``vllm_config.instance_id``
    and the data-parallel rank.

    Scheduler and workers of one engine share it (the config is pickled to every process); two
    engines in one process or on one host, or two data-parallel replicas, never do.
    """
    ktc = vllm_config.kv_transfer_config
    engine_id = str(getattr(ktc, "engine_id", None) or "lmcache-default")
    instance = str(getattr(vllm_config, "instance_id", "") or "")
    pc = getattr(vllm_config, "parallel_config", None)
    dp_rank = int(getattr(pc, "data_parallel_rank", 0) or 0)
    return f"{engine_id}:{instance}:dp{dp_rank}"


def socket_dir(engine_key: str, *, base: str | os.PathLike[str] | None = None) -> Path:
    """The per-engine folder holding the rank sockets (not created here).

    Args:
        engine_key: ``engine_id + ":" + instance_id`` of the vLLM engine.
        base: Folder to put it in (default :func:`tempfile.gettempdir`).

    Returns:
        ``<base>/lmcache-vllm-<uid>-<sha256(engine_key)[:16]>``.
    """
    digest = hashlib.sha256(engine_key.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    root = Path(base) if base is not None else Path(tempfile.gettempdir())
    return root / f"lmcache-vllm-{os.getuid()}-{digest}"


def socket_path(engine_key: str, rank: int, *, base: str | os.PathLike[str] | None = None) -> Path:
    """Socket of ``rank``'s lookup server for ``engine_key`` (see :func:`socket_dir`)."""
    return socket_dir(engine_key, base=base) / f"rank{rank}.sock"


class LogThrottle:
    """Lets a repeated log line through at most once per ``every_s``; counts what it held back."""

    def __init__(self, every_s: float = LOG_EVERY_S) -> None:
        self._every_s = every_s
        self._next = 0.0
        self._held = 0
        self._lock = threading.Lock()

    def ready(self) -> int | None:
        """Lines held back since the last one let through, or ``None`` to hold this one."""
        now = time.monotonic()
        with self._lock:
            if now < self._next:
                self._held += 1
                return None
            self._next = now + self._every_s
            held, self._held = self._held, 0
            return held


def unsafe_folder(folder: Path) -> str | None:
    """Why a client must not connect through ``folder``; ``None`` when it is private or absent."""
    try:
        info = folder.lstat()
    except FileNotFoundError:
        return None  # the connect reports the missing socket
    except OSError as exc:
        return f"cannot stat it ({exc.strerror})"
    if not stat.S_ISDIR(info.st_mode):
        return "it is not a directory"
    if info.st_uid != os.getuid():
        return f"it is owned by uid {info.st_uid}, expected {os.getuid()}"
    if stat.S_IMODE(info.st_mode) & 0o077:
        return f"its mode is {stat.S_IMODE(info.st_mode):04o}, expected 0700"
    return None
