# SPDX-License-Identifier: Apache-2.0
"""lmcache's KV transfers on a CUDA GPU through vLLM's worker, each figure beside its ceiling.

``python benchmarks/gpu_transfer.py [--quick] [--reps N]`` on a CUDA machine; ``--smoke`` runs
every row on a 2-layer geometry with tiny requests (on the CPU when there is no GPU) to check the
script itself. Every transfer goes the way vLLM drives lmcache (``_worker_path.Rig``): the
scheduler side's lookup and the worker side's hooks (``WorkerSide``: its transfer lock, its
streams, its save queue and its lookup-time copy of a hit to the device), with checksums as
configured. Geometry: Llama-8B KV (32 layers, 8 KV heads of 128, bf16: 128 KiB per token) in
vLLM's CUDA layout, 16-token pages in shuffled order, 256-token chunks, the host pool pinned
before timing. On the CPU the worker has no streams: every row runs synchronously, and its
figures only check the script. Every timed figure is the median of ``--reps`` (>= 20 on a GPU)
after warm-up, host wall time from the device idle until the row's work is done. One table,
each row with its ceiling measured in the same run (pinned copies of the same bytes, device time
of back-to-back copies between two events), its target and ``missed`` where missed:

- ``store``: a step that saves one request (``save_kv_layer`` at every layer, ``wait_for_save``)
  until the save job has copied it out of the pages and published its chunks (emptied before
  each, untimed); ceiling: a pinned device-to-host copy. Targets: 16k tokens >= 95 %, 256
  tokens >= 85 % of it.
- ``load``: a new prompt starting with a stored request, from the scheduler's lookup (the worker
  leases the hit and starts copying it to the device) through ``bind_connector_metadata`` and
  ``start_load_kv`` until the load is done on the device; ceiling: a pinned host-to-device
  copy; targets as for ``store``. The progress line says how many loads the lookup copied.
- ``store while loading``: one worker, a step saving a new 16k request then the next step
  loading a stored one (its lookup first), until both are done; both requests' bytes over the
  wall time; ceiling: a device-to-host and a host-to-device copy of the same bytes on two
  streams at once. Target: >= 90 GB/s (an H200).
- ``checksum on vs off``: the 16k store and load of fresh workers with ``lmcache.checksum``
  true and false, each figure; target: on within 3 % of off. The label says what the default
  (every other row) resolves to.
- ``lookup``: ``measure_lookup(32768, 200)`` of ``benchmarks/lookup.py`` when present.
- ``first warm load``: the first worker of the process stores a 16k request, then its first
  load against the median of its later loads (the 16k ``load`` row). Target: <= 1.1x.
- ``GEMM``: a bf16 GEMM's device time (median of back-to-back GEMMs, each between two events)
  while one thread stores and loads 16k requests through the worker in a loop, against the same
  GEMM alone (before and after). Target: < 2 % slower.

Each row's request is first stored, its pages poisoned and loaded back, checked bit for bit.
Exit status 1 when a reload is not bit-exact; a missed target only prints ``missed``.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import threading
import time
from typing import Any

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _common import gbs, median, sync, wall_ms
from _worker_path import (
    CHUNK,
    DTYPE,
    HEAD,
    HEADS,
    PAGE,
    Request,
    Rig,
    ceilings,
    on,
    streams,
    tokens,
)


def store_load(rig: Rig, req: Request, reps: int) -> tuple[float, float, str]:
    """Median ms of a step's save of ``req`` until published, and of a load of it from the
    lookup until it is in the pages; how many of those loads the lookup copied ahead."""
    st = median(wall_ms(rig.device, lambda: rig.store(req), reps, setup=rig.clear))
    rig.clear()
    rig.store(req)
    ahead: list[bool] = []
    ld = median(wall_ms(rig.device, lambda: ahead.append(rig.load(req)), reps, setup=rig.forget))
    rig.forget()
    return st, ld, f"{sum(ahead)}/{len(ahead)} loads copied at lookup"


def duplex(rig: Rig, saves: list[Request], load: Request) -> list[float]:
    """Wall ms of a step saving ``saves[i]`` and the next step loading ``load`` (stored before,
    looked up between the steps), until the save is published and the load in the pages."""
    rig.clear()
    rig.store(load)
    times = []
    for req in saves:
        rig.forget()
        sync(rig.device)
        t = time.perf_counter()
        rig.save(req)  # step N: the save's copy is queued on the save thread
        rig.load(load)  # the scheduler's lookup, step N+1 loading the hit
        rig.saved()
        sync(rig.device)
        times.append((time.perf_counter() - t) * 1e3)
    rig.forget()
    last = saves[-1].tokens
    if rig.engine.lookup(last) != len(last):
        raise SystemExit(f"store while loading: {rig.engine.lookup(last)} of {len(last)} stored")
    return times


def gemm_ms(a: torch.Tensor, b: torch.Tensor, stream: Any, count: int) -> float:
    """Median device ms of ``count`` back-to-back ``a @ b`` on ``stream``.

    A spin kernel holds the stream while the host enqueues every GEMM and its events, so that
    the host's pace (the GIL shared with the traffic thread) leaves no gap inside a timing.
    """
    if stream is None:  # the CPU smoke
        return median(wall_ms(a.device, lambda: a @ b, count))
    with on(stream):
        torch.cuda._sleep(200_000_000)  # type: ignore[no-untyped-call]  # ~0.1 s at 2 GHz
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))  # type: ignore[no-untyped-call]
            for _ in range(count)
        ]
        for start, end in events:
            start.record()
            a @ b
            end.record()
    torch.cuda.synchronize(a.device)
    return median([start.elapsed_time(end) for start, end in events])


def gemm_slowdown(rig: Rig, req: Request, size: int, count: int) -> tuple[float, float]:
    """(GEMM ms alone, before and after; GEMM ms while one thread stores and loads ``req``
    through the worker in a loop, that thread's compute stream its own)."""
    device = rig.device
    a = torch.randn(size, size, device=device, dtype=DTYPE)
    b = torch.randn(size, size, device=device, dtype=DTYPE)
    s_gemm, s_bg = streams(device, 2)
    stop, running = threading.Event(), threading.Event()
    failed: list[BaseException] = []

    def traffic() -> None:
        try:
            with on(s_bg):
                while not stop.is_set():
                    rig.clear()
                    rig.store(req)
                    rig.load(req)
                    running.set()
        except BaseException as exc:  # re-raised on the main thread
            failed.append(exc)
            running.set()

    gemm_ms(a, b, s_gemm, 10)  # warm-up
    alone = gemm_ms(a, b, s_gemm, count)
    thread = threading.Thread(target=traffic)
    thread.start()
    try:
        running.wait()  # one store and load done: the traffic is under way
        busy = gemm_ms(a, b, s_gemm, count)
    finally:
        stop.set()
        thread.join()
    rig.forget()
    if failed:
        raise RuntimeError("the store/load traffic beside the GEMMs failed") from failed[0]
    return (alone + gemm_ms(a, b, s_gemm, count)) / 2, busy


def lookup_p99() -> tuple[float, float] | str:
    """``(p50, p99)`` ms from ``benchmarks/lookup.py``'s ``measure_lookup``, or why not."""
    try:
        from lookup import measure_lookup
    except ImportError:
        return "not measured (benchmarks/lookup.py absent)"
    try:
        res = measure_lookup(num_tokens=32768, repeats=200)
    except Exception as exc:  # report it in the table, not as a traceback
        return f"failed: {exc!r}"[:60]
    scale = {"_us": 1e-3, "_ms": 1.0, "_s": 1e3, "": 1.0}  # plain p50/p99: milliseconds
    for suffix, factor in scale.items():
        if f"p99{suffix}" in res:
            return res[f"p50{suffix}"] * factor, res[f"p99{suffix}"] * factor
    return f"no p99 key in {sorted(res)}"[:60]


Row = tuple[str, str, str, str, str, bool | None]  # what, measured, ceiling, ratio, target, met


def transfer_rows(
    label: str, req: Request, st: float, ld: float, ceil: dict[str, float], want: float
) -> list[Row]:
    n = req.nbytes
    out: list[Row] = []
    for what, ms, way in (("store", st, "d2h"), ("load", ld, "h2d")):
        ratio = ceil[way] / ms
        out.append(
            (
                f"{label} {what}",
                f"{gbs(n, ms):.1f} GB/s ({ms:.2f} ms)",
                f"pinned {way} {gbs(n, ceil[way]):.1f} GB/s",
                f"{100 * ratio:.0f} %",
                f">= {100 * want:.0f} % of ceiling",
                ratio >= want,
            )
        )
    return out


def checksum_rows(
    label: str, nbytes: int, on_off: dict[bool, tuple[float, float]], ceil: dict[str, float]
) -> list[Row]:
    """Store and load with checksums on against off: each figure, on within 3 % of off."""
    out: list[Row] = []
    for i, (what, way) in enumerate((("store", "d2h"), ("load", "h2d"))):
        on_ms, off_ms = on_off[True][i], on_off[False][i]
        out.append(
            (
                f"{label} {what}",
                f"on {gbs(nbytes, on_ms):.1f} GB/s ({on_ms:.2f} ms)",
                f"off {gbs(nbytes, off_ms):.1f}, pinned {way} {gbs(nbytes, ceil[way]):.1f} GB/s",
                f"{100 * off_ms / on_ms:.1f} % of off",
                ">= 97 % of off",
                off_ms / on_ms >= 0.97,
            )
        )
    return out


def print_table(title: str, rows: list[Row]) -> None:
    head: Row = ("row", "measured", "ceiling (same run)", "ratio", "target", None)
    cells = [(*r[:5], "" if r[5] is None else "met" if r[5] else "missed") for r in [head, *rows]]
    widths = [max(len(c[i]) for c in cells) for i in range(6)]
    print(f"=== {title}")
    for i, c in enumerate(cells):
        print("  ".join(x.ljust(w) for x, w in zip(c, widths, strict=True)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--reps", type=int, default=None, help="timed samples per figure (default 30; --quick 20)"
    )
    parser.add_argument("--quick", action="store_true", help="20 samples per figure, fewer GEMMs")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="a 2-layer geometry, tiny requests, few samples (CPU without a GPU): checks the script",
    )
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        raise SystemExit("gpu_transfer.py needs a CUDA GPU (--smoke runs it on the CPU)")
    device = torch.device("cuda" if cuda else "cpu")
    reps = args.reps or (3 if args.smoke else 20 if args.quick else 30)
    layers, big, small = (2, 1024, 256) if args.smoke else (32, 16384, 256)
    gemm_size, gemm_count = (256, 10) if args.smoke else (8192, 100 if args.quick else 200)
    token_bytes = layers * 2 * HEADS * HEAD * DTYPE.itemsize

    def pool_gib(n: int) -> float:  # a host pool of n tokens and 4 chunks: the smoke evicts too
        return (n + 4 * CHUNK) * token_bytes / 2**30

    name = torch.cuda.get_device_name() if cuda else "CPU (smoke)"
    k = f"{big // 1024}k"
    print(
        f"{name}: {layers} layers, {HEADS} KV heads of {HEAD}, bf16, {PAGE}-token pages, "
        f"{reps} samples per figure",
        flush=True,
    )
    rows: list[Row] = []
    exact = {}

    # the first worker of the process, default config; its host pool holds three 16k requests
    # (store while loading: the one loaded, the last one saved, the one saving now)
    rig = Rig(device, layers, 2 * big + small + 4 * PAGE, pool_gib(3 * big + small), None)
    a, b, s = rig.request(big, 1), rig.request(big, 2), rig.request(small, 3)
    rig.store(a)
    first = wall_ms(device, lambda: rig.load(a), 1, warmup=0)[0]
    rig.forget()
    print(f"first load {first:.2f} ms", flush=True)
    for label, req, want in ((f"{k}-token", a, 0.95), (f"{small}-token", s, 0.85)):
        exact[label] = rig.bit_exact(req)
        st, ld, ahead = store_load(rig, req, reps)
        ceil = ceilings(device, req.nbytes, reps)
        rows += transfer_rows(label, req, st, ld, ceil, want)
        copies = ", ".join(f"{way} {ms:.3f}" for way, ms in ceil.items())
        print(f"{label}: store {st:.2f}, load {ld:.2f} ({ahead}); pinned {copies} ms", flush=True)
        if req is a:
            big_ceil, later = ceil, ld
    fresh = [dataclasses.replace(b, tokens=tokens(big, 100 + i)) for i in range(3 + reps)]
    both = median(duplex(rig, fresh, a)[3:])
    total = 2 * a.nbytes
    rows.append(
        (
            f"one worker storing one {k} request (a step's save) while loading another",
            f"{gbs(total, both):.1f} GB/s ({both:.2f} ms)",
            f"duplex {gbs(total, big_ceil['duplex']):.1f} GB/s",
            f"{100 * big_ceil['duplex'] / both:.0f} %",
            ">= 90 GB/s",
            gbs(total, both) >= 90,
        )
    )
    alone, busy = gemm_slowdown(rig, a, gemm_size, gemm_count)
    connector = rig.engine.gpu_connector
    on_device = connector is not None and connector.verifies_checksums
    default_on = rig.engine.config.checksum_for(device.type, on_device)
    rig.close()
    print(f"store while loading {both:.2f} ms; GEMM {alone:.3f} / {busy:.3f} ms", flush=True)

    on_off: dict[bool, tuple[float, float]] = {}
    for flag in (True, False):  # fresh workers with lmcache.checksum set either way
        rig = Rig(device, layers, big + 4 * PAGE, pool_gib(big), flag)
        req = rig.request(big, 1)
        exact[f"{k}-token, checksum {'on' if flag else 'off'}"] = rig.bit_exact(req)
        on_off[flag] = store_load(rig, req, reps)[:2]
        rig.close()
        print(f"checksum {flag}: store {on_off[flag][0]:.2f}, load {on_off[flag][1]:.2f} ms")
    label = f"checksum on vs off (default: {'on' if default_on else 'off'}), {k}"
    rows += checksum_rows(label, a.nbytes, on_off, big_ceil)
    found = lookup_p99()
    rows.append(
        (
            "lookup of a fully cached 32k-token prompt",
            found if isinstance(found, str) else f"p99 {found[1]:.3f} ms (p50 {found[0]:.3f})",
            "-",
            "-",
            "p99 < 0.2 ms",
            None if isinstance(found, str) else found[1] < 0.2,
        )
    )
    rows.append(
        (
            f"first warm {k} load of a fresh worker",
            f"{first:.2f} ms",
            f"later loads {later:.2f}, pinned h2d {big_ceil['h2d']:.2f} ms",
            f"{first / later:.2f}x",
            "<= 1.1x",
            first / later <= 1.1,
        )
    )
    slow = busy / alone - 1
    rows.append(
        (
            f"a concurrent bf16 GEMM ({gemm_size}^3) slowed by",
            f"{100 * slow:+.1f} % ({busy:.3f} ms)",
            f"alone {alone:.3f} ms",
            "-",
            "< 2 %",
            slow < 0.02,
        )
    )
    print()
    print_table(
        f"lmcache on {name}: vLLM's worker (WorkerSide) + vllm.{device.type}, Llama-8B KV "
        f"geometry, medians of {reps}",
        rows,
    )
    print("bit-exact reload: " + ", ".join(f"{w} {'yes' if v else 'NO'}" for w, v in exact.items()))
    return 0 if all(exact.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
