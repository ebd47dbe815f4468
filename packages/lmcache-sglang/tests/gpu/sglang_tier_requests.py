# SPDX-License-Identifier: Apache-2.0
"""The engine worker of ``test_real_sglang_cuda.py`` reads or damages lmcache's CPU tier in
SGLang's scheduler process.

lmcache's process tier (``lmcache.tiers.process_tier``) lives in the scheduler, which SGLang
spawns: it imports the worker script as ``__mp_main__``, which calls :func:`start_watcher`. The
worker writes ``req-N.json`` into the folder named by :data:`ENV` (:func:`ask`); the one process
whose tier holds entries answers with ``req-N.done.json`` (:func:`tier_report`), after flipping
one byte of one entry when asked. Standard library only until a request is answered; imported
only by the worker and the processes it spawns (its folder is the script's).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

ENV = "LMC_GPU_TIER_REQUESTS"
"""The folder of the worker's requests, inherited by the processes SGLang spawns."""


def tier_report(flip: int | None) -> dict[str, Any] | None:
    """What lmcache's process CPU tier holds, after flipping one byte of entry ``flip`` (in the
    order stored) when given; ``None`` in a process whose tier holds nothing (one that runs no
    lmcache hook, e.g. SGLang's detokenizer)."""
    process_tier = sys.modules.get("lmcache.tiers.process_tier")
    if process_tier is None:
        return None
    entries: list[Any] = []
    for tier in list(process_tier._tiers.values()):
        with tier._lock:
            entries += list(tier._entries.values())
    if not entries:
        return None
    report: dict[str, Any] = {
        "pid": os.getpid(),
        "entries": len(entries),
        "device_sums": sum(e.lease.checksum is not None and e.checksum is None for e in entries),
        "host_sums": sum(e.checksum is not None for e in entries),
    }
    if flip is not None:
        import torch

        at = min(flip, len(entries) - 1)
        entry = entries[at]
        data = entry.lease.tensor.reshape(-1).view(torch.uint8)
        data[data.numel() // 2] ^= 0x10
        report.update(
            flipped=at,
            device_sum=entry.lease.checksum is not None,
            host_sum=entry.checksum is not None,
        )
    return report


def _watch(folder: Path) -> None:
    """Answer each request in ``folder`` that this process can answer (see the module docs)."""
    answered: set[str] = set()
    while True:
        time.sleep(0.1)
        for req in sorted(folder.glob("req-*.json")):
            if ".done" in req.name or req.name in answered:
                continue
            done = req.with_name(req.name.replace(".json", ".done.json"))
            if done.exists():
                continue
            try:
                report = tier_report(json.loads(req.read_text()).get("flip"))
            except Exception as exc:  # answered: the worker reports it
                report = {"pid": os.getpid(), "error": repr(exc)}
            if report is None:
                continue  # another process holds the tier
            answered.add(req.name)
            tmp = done.with_name(f"{done.name}.{os.getpid()}")
            tmp.write_text(json.dumps(report))
            os.replace(tmp, done)


def start_watcher() -> None:
    """In a process SGLang spawned from the worker: answer the worker's requests (a daemon
    thread), when the worker named a folder."""
    folder = os.environ.get(ENV)
    if folder:
        threading.Thread(
            target=_watch, args=(Path(folder),), name="lmcache-gpu-tier-requests", daemon=True
        ).start()


def ask(folder: Path, seq: int, flip: int | None, timeout: float = 30.0) -> dict[str, Any]:
    """In the worker: :func:`tier_report` from SGLang's scheduler (request number ``seq``).

    Raises:
        RuntimeError: no process answered within ``timeout`` s, or the answer is an error.
    """
    req = folder / f"req-{seq}.json"
    tmp = folder / f"req-{seq}.tmp"
    tmp.write_text(json.dumps({"flip": flip}))
    os.replace(tmp, req)
    done = folder / f"req-{seq}.done.json"
    deadline = time.monotonic() + timeout
    while not done.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"no SGLang process answered {req.name}: no lmcache tier entries?")
        time.sleep(0.1)
    report: dict[str, Any] = json.loads(done.read_text())
    if "error" in report:
        raise RuntimeError(f"the scheduler failed to answer {req.name}: {report['error']}")
    return report
