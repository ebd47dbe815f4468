# SPDX-License-Identifier: Apache-2.0
"""A real node cache owner process for tests (``python -m lmcache.node serve``), and a way to run
client code in other real processes.

::

    with NodeOwner(tmp_path / "node", budget_bytes=1 << 20) as owner:
        ...              # engines with node_cache_dir=str(owner.folder) share chunks
        owner.kill()     # SIGKILL, as a crash would
        owner.start()    # a new owner: a new arena generation

:class:`TierChild` is an engine process holding a :class:`~lmcache.tiers.node_tier.NodeTier`,
driven line by line (``python -m lmcache.testing.node_owner FOLDER``): it stores, checks and
holds chunks made by :func:`chunk_bytes`, which every process computes alike.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from lmcache.node import wire
from lmcache.node.arena import SOCKET_NAME

if TYPE_CHECKING:
    import torch

    from lmcache.memory import MemoryLease
    from lmcache.tiers.node_tier import NodeTier

__all__ = [
    "CHUNK_SHAPE",
    "NodeOwner",
    "TierChild",
    "check_chunks",
    "chunk_bytes",
    "chunk_keys",
    "python_child",
    "store_chunks",
]

CHUNK_SHAPE = (2, 16, 64)
"""``[layers, tokens, width]`` of the test chunks (bfloat16: 4 KiB each)."""


class NodeOwner:
    """An owner of ``folder`` run as a child process (see the module docstring).

    Args:
        folder: The node cache folder (created 0700).
        budget_bytes: Its arena size.
        grace_s: ``--grace-s``: how long a live process's leases outlast its connection.
    """

    def __init__(self, folder: str | os.PathLike[str], budget_bytes: int, grace_s: float = 1.0):
        self.folder = Path(folder)
        self.budget_bytes = budget_bytes
        self.grace_s = grace_s
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout: float = 20.0) -> NodeOwner:
        """Start it and wait until it welcomes a client.

        Raises:
            RuntimeError: it exited or did not answer within ``timeout`` seconds.
        """
        cmd = [
            sys.executable,
            "-m",
            "lmcache.node",
            "serve",
            "--dir",
            str(self.folder),
            "--budget-bytes",
            str(self.budget_bytes),
            "--grace-s",
            str(self.grace_s),
        ]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                raise RuntimeError(f"node owner exited with {self.proc.returncode}: {err}")
            if self.generation() is not None:
                return self
            time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"node owner did not answer within {timeout} s")

    def generation(self) -> str | None:
        """The running owner's generation, asked over its socket (``None``: no answer)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(1.0)
        try:
            sock.connect(str(self.folder / SOCKET_NAME))
            token = os.urandom(16)
            sock.sendall(wire.encode(wire.Hello(wire.PROTOCOL_VERSION, token, 0, "", [])))
            reply = wire.decode_reply(wire.read_frame(sock))
        except (OSError, wire.FrameError):
            return None
        finally:
            sock.close()
        return reply.generation if isinstance(reply, wire.Welcome) else None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` and reap the process."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(10)
        if self.proc is not None and self.proc.stderr is not None:
            self.proc.stderr.close()

    def __enter__(self) -> NodeOwner:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.kill(signal.SIGTERM)


def python_child(code: str, *args: str) -> subprocess.Popen[str]:
    """Run ``code`` in a new Python process (``sys.argv[1:]`` = ``args``), with pipes for its
    stdin and stdout (text, line-buffered) to drive it step by step."""
    return subprocess.Popen(
        [sys.executable, "-u", "-c", code, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        bufsize=1,
    )


def chunk_keys(seed: int, n: int) -> list[bytes]:
    """Keys of chain ``seed``: ``n`` distinct 16-byte keys."""
    return [bytes([seed % 256, i % 256, i // 256 % 256, 0]) * 4 for i in range(n)]


def chunk_bytes(seed: int, i: int) -> torch.Tensor:
    """Chunk ``i`` of chain ``seed``: bfloat16 ``CHUNK_SHAPE``, the same in every process."""
    import torch

    gen = torch.Generator().manual_seed(seed * 100_000 + i)
    return torch.randn(CHUNK_SHAPE, generator=gen).to(torch.bfloat16)


def store_chunks(tier: NodeTier, seed: int, n: int, owner: bytes = b"test") -> int:
    """Allocate, fill, commit (checksummed, with parents) and touch chain ``seed``'s first ``n``
    chunks, protecting the chain; returns how many were stored."""
    import torch

    from lmcache.tiers.cpu_tier import tensor_checksum

    keys = chunk_keys(seed, n)
    leases = tier.allocate_many(CHUNK_SHAPE, torch.bfloat16, n, protect=frozenset(keys))
    for i, (key, lease) in enumerate(zip(keys, leases, strict=False)):
        lease.tensor.copy_(chunk_bytes(seed, i))
        parent = keys[i - 1] if i else None
        tier.put(key, lease, tensor_checksum(lease.tensor), owner=owner, parent=parent)
    tier.touch_many(keys[: len(leases)])
    for lease in leases:
        lease.release()
    return len(leases)


def check_chunks(tier: NodeTier, seed: int, n: int, hold: list[MemoryLease] | None = None) -> int:
    """How many leading chunks of chain ``seed`` the tier hands out, verified and equal to
    :func:`chunk_bytes` bit for bit (leases kept in ``hold`` when given, else released)."""
    import torch

    found = 0
    for i, key in enumerate(chunk_keys(seed, n)):
        lease = tier.get(key)
        if lease is None:
            break
        same = torch.equal(lease.tensor.view(torch.int16), chunk_bytes(seed, i).view(torch.int16))
        if hold is not None:
            hold.append(lease)
        else:
            lease.release()
        if not same:
            break
        found += 1
    return found


class TierChild:
    """An engine process with a node tier on ``folder``, driven by commands (one reply line
    each): ``store SEED N``, ``check SEED N``, ``hold SEED N`` (check, keeping the leases),
    ``alloc N`` (lease N more blocks), ``commit SEED`` (fill the held blocks as chain SEED and
    commit them), ``missing SEED N``."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.proc = python_child(
            "import sys; from lmcache.testing.node_owner import _child_main; _child_main()",
            str(folder),
        )
        assert self.ask("ping") == "pong"

    def ask(self, line: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


def _child_main(argv: Sequence[str] | None = None) -> None:
    import torch

    from lmcache.metrics import LMCacheMetrics
    from lmcache.node.client import NodeClient
    from lmcache.tiers.cpu_tier import tensor_checksum
    from lmcache.tiers.node_tier import NodeTier

    args = list(sys.argv[1:] if argv is None else argv)
    tier = NodeTier(NodeClient(args[0], budget_bytes=0, autostart=False), LMCacheMetrics())
    tier.client.connect(20.0)
    held: list[MemoryLease] = []
    for line in sys.stdin:
        cmd, *rest = line.split()
        nums = [int(x) for x in rest]
        if cmd == "ping":
            out = "pong"
        elif cmd == "store":
            out = str(store_chunks(tier, nums[0], nums[1], owner=b"child"))
        elif cmd == "check":
            out = str(check_chunks(tier, nums[0], nums[1]))
        elif cmd == "hold":
            out = str(check_chunks(tier, nums[0], nums[1], held))
        elif cmd == "alloc":
            held += tier.allocate_many(CHUNK_SHAPE, torch.bfloat16, nums[0])
            out = str(len(held))
        elif cmd == "commit":  # fill and commit the held blocks as chain SEED
            keys = chunk_keys(nums[0], len(held))
            for i, (key, lease) in enumerate(zip(keys, held, strict=True)):
                lease.tensor.copy_(chunk_bytes(nums[0], i))
                parent = keys[i - 1] if i else None
                tier.put(key, lease, tensor_checksum(lease.tensor), parent=parent)
            out = str(len(keys))
        elif cmd == "missing":
            out = " ".join(map(str, tier.missing(chunk_keys(nums[0], nums[1])))) or "-"
        else:
            out = f"unknown command {cmd}"
        print(out, flush=True)
