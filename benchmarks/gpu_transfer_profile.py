# SPDX-License-Identifier: Apache-2.0
"""Where the host time of one store and one load goes: the rows of ``gpu_transfer.py`` that
the host bounds (a 256-token request moves 32 MiB, about 0.6 ms at the PCIe ceiling).

``python benchmarks/gpu_transfer_profile.py [--tokens 256] [--reps 200] [--top 25]`` on a CUDA
machine (``--smoke``: a 2-layer geometry on the CPU, to check the script). The geometry and
engine are ``gpu_transfer.py``'s (Llama-8B KV, default config: checksums on). For each
direction it prints two medians and one profile:

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

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import gpu_transfer as bench
from _common import median, sync


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
    cache = bench.Cache(device, layers, args.tokens + 4 * bench.PAGE)
    req = cache.request(args.tokens, 1)
    engine = cache.engine(max(4 * req.nbytes / 2**30, 0.25), None)
    ceil = bench.ceilings(device, req.nbytes, 20)
    print(
        f"{args.tokens} tokens, {req.nbytes / 2**20:.1f} MiB, {layers} layers; pinned copy: "
        f"d2h {ceil['d2h']:.3f} ms, h2d {ceil['h2d']:.3f} ms",
        flush=True,
    )
    try:
        store, load = bench.store_fn(engine, req), bench.load_fn(engine, req)
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
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
