# SPDX-License-Identifier: Apache-2.0
"""Where the host time of one store and one load goes: the rows of ``gpu_transfer.py`` that
the host bounds (a 256-token request moves 32 MiB, about 0.6 ms at the PCIe ceiling).

``python benchmarks/gpu_transfer_profile.py [--tokens 256] [--reps 200] [--top 25]`` on a CUDA
machine (``--smoke``: a 2-layer geometry on the CPU, to check the script). The geometry and
engine are ``gpu_transfer.py``'s: the engine that vLLM's worker builds over its caches
(``_worker_path.Rig``: Llama-8B KV, default config). The calls profiled are that engine's
``store`` and ``retrieve`` on this thread, not the worker's hooks: the worker copies a save on
its own thread, which cProfile does not see. For each direction it prints two medians and one
profile:

- ``host``: from the call to its return;
- ``total``: from the call until the device is idle;
- the cProfile of the calls (device idle before each), by own time and by cumulative time.

The gap between ``total`` and the pinned-copy time of the same bytes is what lies to win.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pathlib
import pstats
import sys
import time
from collections.abc import Callable

import torch

from lmcache.gpu_connector import TransferSpec
from lmcache_vllm.transfer.transfer_plan import slot_mapping

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _common import median, sync
from _worker_path import DTYPE, HEAD, HEADS, PAGE, Rig, ceilings


def split_ms(
    device: torch.device, fn: Callable[[], object], reps: int, setup: Callable[[], object] | None
) -> tuple[float, float]:
    """Median ms of ``fn`` until it returns, and until the device is idle after it."""
    host, total = [], []
    for i in range(reps + 3):
        if setup is not None:
            setup()
        sync(device)
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        sync(device)
        t2 = time.perf_counter()
        if i >= 3:  # warm-up
            host.append((t1 - t0) * 1e3)
            total.append((t2 - t0) * 1e3)
    return median(host), median(total)


def profile(
    device: torch.device,
    fn: Callable[[], object],
    reps: int,
    setup: Callable[[], object] | None,
    top: int,
) -> str:
    """The cProfile of ``reps`` calls of ``fn`` (each until the device is idle), two views."""
    prof = cProfile.Profile()
    for _ in range(reps):
        if setup is not None:
            setup()
        sync(device)
        prof.enable()
        fn()
        sync(device)
        prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256, help="tokens per request")
    parser.add_argument("--reps", type=int, default=200, help="timed calls per figure")
    parser.add_argument("--top", type=int, default=25, help="profile lines per view")
    parser.add_argument("--smoke", action="store_true", help="2 layers, on the CPU without a GPU")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        raise SystemExit("gpu_transfer_profile.py needs a CUDA GPU (--smoke runs it on the CPU)")
    device = torch.device("cuda" if cuda else "cpu")
    layers = 32 if cuda else 2
    nbytes = args.tokens * layers * 2 * HEADS * HEAD * DTYPE.itemsize
    rig = Rig(device, layers, args.tokens + 4 * PAGE, max(4 * nbytes / 2**30, 0.25), None)
    req, engine = rig.request(args.tokens, 1), rig.engine
    ceil = ceilings(device, req.nbytes, 20)
    print(
        f"{args.tokens} tokens, {req.nbytes / 2**20:.1f} MiB, {layers} layers; pinned copy: "
        f"d2h {ceil['d2h']:.3f} ms, h2d {ceil['h2d']:.3f} ms",
        flush=True,
    )
    try:
        spec = TransferSpec(slot_mapping(req.blocks, PAGE, len(req.tokens)))

        def store() -> object:
            return engine.store(req.tokens, None, spec)

        def load() -> object:
            return engine.retrieve(req.tokens, None, spec)

        for what, fn, setup, way in (
            ("store", store, engine.clear, "d2h"),
            ("load", load, None, "h2d"),
        ):
            if setup is None:
                engine.clear()
                store()
            host, total = split_ms(device, fn, args.reps, setup)
            print(
                f"=== {what}: host {host:.3f} ms, total {total:.3f} ms, "
                f"pinned {way} {ceil[way]:.3f} ms ({100 * ceil[way] / total:.0f} %)"
            )
            print(profile(device, fn, args.reps, setup, args.top), flush=True)
    finally:
        rig.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
