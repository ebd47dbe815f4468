# SPDX-License-Identifier: Apache-2.0
"""``python -m lmcache.node``: run a node cache owner, or print an owner's counters.

``serve`` runs the owner of a folder in the foreground until SIGTERM/SIGINT (or ``--idle-exit``
seconds without an engine); it exits with status 0 at once when the folder has an owner already.
``stats`` prints the running owner's counters as JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import signal
import socket
import sys
from collections.abc import Sequence

from lmcache.node import wire
from lmcache.node.arena import SOCKET_NAME, NodeCacheError, default_dir, ensure_private_dir
from lmcache.node.server import NodeServer, OwnerRunning

__all__ = ["main"]

logger = logging.getLogger("lmcache.node")


def _serve(args: argparse.Namespace) -> int:
    budget = args.budget_bytes
    if budget is None:
        budget = int(float(args.budget_gb) * 1024**3)
    try:
        server = NodeServer(args.dir, budget, grace_s=args.grace_s, idle_exit_s=args.idle_exit)
        server.start()
    except OwnerRunning as exc:
        logger.info("%s", exc)
        return 0
    except NodeCacheError as exc:
        logger.error("%s", exc)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    signal.signal(signal.SIGINT, lambda *_: server.stop())
    server.serve_forever()
    return 0


def _stats(args: argparse.Namespace) -> int:
    folder = ensure_private_dir(args.dir)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(2.0)
    try:
        sock.connect(str(folder / SOCKET_NAME))
        hello = wire.Hello(wire.PROTOCOL_VERSION, secrets.token_bytes(16), os.getpid(), "", [])
        # one request, then its reply: the client's frame reader expects one reply per read
        sock.sendall(wire.encode(hello))
        wire.decode_reply(wire.read_frame(sock))
        sock.sendall(wire.encode(wire.Stats()))
        reply = wire.decode_reply(wire.read_frame(sock))
    except (OSError, wire.FrameError) as exc:
        print(f"no node cache owner answers at {folder}: {exc}", file=sys.stderr)
        return 1
    finally:
        sock.close()
    fields = getattr(reply, "__struct_fields__", ())
    print(json.dumps({name: getattr(reply, name) for name in fields}, indent=2))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the subcommand; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m lmcache.node", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the owner of a node cache folder")
    serve.add_argument("--dir", default=str(default_dir()), help="node cache folder")
    size = serve.add_mutually_exclusive_group()
    size.add_argument("--budget-bytes", type=int, help="arena size in bytes")
    size.add_argument("--budget-gb", default="5.0", help="arena size in GiB (default 5.0)")
    serve.add_argument("--grace-s", type=float, default=10.0, help="lease grace after a drop")
    serve.add_argument(
        "--idle-exit", type=float, default=0.0, help="exit after S s idle (0: never)"
    )
    stats = sub.add_parser("stats", help="print the running owner's counters")
    stats.add_argument("--dir", default=str(default_dir()), help="node cache folder")
    args = parser.parse_args(argv)
    level = getattr(logging, os.environ.get("LMCACHE_LOG_LEVEL", "").strip().upper(), None)
    logging.basicConfig(
        level=level if isinstance(level, int) else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    if args.command == "serve":
        return _serve(args)
    return _stats(args)


if __name__ == "__main__":
    sys.exit(main())
