# SPDX-License-Identifier: Apache-2.0
"""lmcache's KV transfers on a CUDA GPU, every figure beside its ceiling measured in the same run.

``python benchmarks/gpu_transfer.py [--quick] [--reps N]`` on a CUDA machine; ``--smoke`` runs
every row on a 2-layer geometry (on the CPU when there is no GPU) to check the script itself.
Geometry: Llama-8B KV (32 layers, 8 KV heads of 128, bf16: 128 KiB per token) in vLLM's CUDA
FlashAttention layout (per layer a ``[blocks, heads, 16, 256]`` view of one
``[layers, blocks, 16, heads, 256]`` buffer), 16-token pages in shuffled order, 256-token chunks,
through ``LMCacheEngine`` and the ``vllm.cuda`` connector, the host pool pinned before timing.
Every timed figure is the median of ``--reps`` (>= 20) after warm-up; only what the row names is
timed. One table, each row with its ceiling, target and ``missed`` where missed:

- ``store`` / ``load``: ``LMCacheEngine.store`` (emptied before each, untimed) / ``retrieve`` of
  one request, host wall time; ceiling: pinned ``copy_`` of the same bytes each way, device time
  of back-to-back copies between two events. The reload is checked bit for bit (poisoned pages).
- ``store while loading``: one engine, one thread storing a new 16k request while another loads
  a stored one, each on its own stream; both requests' bytes over the wall time; ceiling: a
  device-to-host and a host-to-device copy of the same bytes on two streams at once.
- ``checksum``: the 16k store and load of the default engine (checksums on, summed and verified
  on the GPU) against the same with ``checksum=False``, and what ``checksum`` resolves to by
  default for the CUDA connector. Every other row uses the default config.
- ``lookup``: ``measure_lookup(32768, 200)`` of ``benchmarks/lookup.py`` when present.
- ``first warm load``: a fresh engine (the first of the process), one store, then its first
  load against the median of its later loads.
- ``GEMM``: a bf16 GEMM's device time (median of back-to-back GEMMs, each between two events)
  while one thread stores and loads 16k requests in a loop, against the same GEMM alone (before
  and after).

Exit status 1 when a reload is not bit-exact; a missed target only prints ``missed``.
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from lmcache.cache_engine import LMCacheEngine
from lmcache.config import LMCacheConfig
from lmcache.gpu_connector import CreateGPUConnector, EngineInfo, TransferSpec
from lmcache.metadata import LMCacheMetadata

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _common import event_ms, gbs, median, sync, wall_ms

HEADS, HEAD, PAGE, CHUNK = 8, 128, 16, 256
DTYPE = torch.bfloat16


@dataclass
class Request:
    tokens: torch.Tensor  # [n] token ids (CPU)
    pages: torch.Tensor  # [pages] page ids on the device
    slots: torch.Tensor  # [n] slot of every token (host)
    nbytes: int


class Cache:
    """One paged KV cache in vLLM's CUDA layout and the requests placed in it."""

    def __init__(self, device: torch.device, layers: int, tokens: int) -> None:
        self.device, self.num_layers = device, layers
        blocks = tokens // PAGE + 8
        raw = torch.randn(layers, blocks, PAGE, HEADS, 2 * HEAD, device=device, dtype=DTYPE)
        self.raw = raw
        self.layers = [raw[i].permute(0, 2, 1, 3) for i in range(layers)]
        self._free = (torch.randperm(blocks - 1) + 1).tolist()  # shuffled; page 0 unused

    def request(self, n: int, seed: int) -> Request:
        """A request of ``n`` tokens on pages of its own."""
        count = -(-n // PAGE)
        if count > len(self._free):
            raise ValueError(f"the cache has {len(self._free)} free pages; {count} needed")
        pages, self._free = self._free[:count], self._free[count:]
        page_t = torch.tensor(pages, device=self.device)
        slots = (page_t[:, None] * PAGE + torch.arange(PAGE, device=self.device)).reshape(-1)[:n]
        # on the host, as vLLM's adapter builds them: the kernels' index is checked there
        return Request(tokens(n, seed), page_t, slots.cpu(), n * self.token_bytes)

    @property
    def token_bytes(self) -> int:
        return self.num_layers * 2 * HEADS * HEAD * DTYPE.itemsize

    def engine(self, gib: float, checksum: bool | None) -> LMCacheEngine:
        """A fresh engine and ``vllm.<device>`` connector, its host pool pinned (untimed)."""
        config = LMCacheConfig(chunk_size=CHUNK, max_local_cpu_size=gib, checksum=checksum)
        meta = LMCacheMetadata(
            model_name="bench/llama-8b",
            world_size=1,
            worker_id=0,
            local_worker_id=0,
            local_world_size=1,
            kv_dtype=DTYPE,
            num_layers=self.num_layers,
            num_kv_heads=HEADS,
            head_size_k=HEAD,
            head_size_v=HEAD,
            chunk_size=CHUNK,
        )
        # the smoke on the CPU: CUDA's block format (layout_hints), not vLLM's CPU one
        hints = {"kv_format": "kv_concat"} if self.device.type == "cpu" else None
        info = EngineInfo("vllm", self.device.type, self.layers, {"block_size": PAGE})
        connector = CreateGPUConnector(config, meta, info, hints)
        engine = LMCacheEngine(config, meta, connector, lower_tiers=())
        if not engine.pool.wait_prepinned(timeout=300):
            raise SystemExit("the host pool was not pinned within 300 s")
        return engine


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 100_000, (n,), generator=torch.Generator().manual_seed(seed))


def store_fn(engine: LMCacheEngine, req: Request, stream: Any = None) -> Callable[[], int]:
    return lambda: engine.store(req.tokens, None, TransferSpec(req.slots, stream=stream))


def load_fn(engine: LMCacheEngine, req: Request, stream: Any = None) -> Callable[[], Any]:
    return lambda: engine.retrieve(req.tokens, None, TransferSpec(req.slots, stream=stream))


def bit_exact(cache: Cache, engine: LMCacheEngine, req: Request) -> bool:
    """Store, poison the pages, load: are the full pages' bits back?"""
    engine.clear()
    store_fn(engine, req)()
    want = torch.stack([layer[req.pages] for layer in cache.layers]).clone()
    for layer in cache.layers:
        layer[req.pages] = float("nan")
    mask = load_fn(engine, req)()
    sync(cache.device)
    got = torch.stack([layer[req.pages] for layer in cache.layers])
    full = req.tokens.numel() // PAGE
    same = torch.equal(got[:, :full].view(torch.int16), want[:, :full].view(torch.int16))
    return bool(mask.all()) and same


def streams(device: torch.device, count: int) -> list[Any]:
    if device.type != "cuda":
        return [None] * count
    return [torch.cuda.Stream(device) for _ in range(count)]  # type: ignore[no-untyped-call]


@contextlib.contextmanager
def on(stream: Any) -> Iterator[None]:
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        yield


def ceilings(device: torch.device, nbytes: int, reps: int) -> dict[str, float]:
    """Pinned copies of ``nbytes``: device ms per copy each way, and both ways at once."""
    pin = device.type == "cuda"
    host = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
    dev = [torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device) for _ in range(2)]
    host[1].copy_(dev[1])
    inner = max(1, (256 << 20) // nbytes)  # >= 256 MiB between two events
    d2h = median(event_ms(device, lambda: host[0].copy_(dev[0], non_blocking=True), reps, 3, inner))
    h2d = median(event_ms(device, lambda: dev[1].copy_(host[1], non_blocking=True), reps, 3, inner))
    s_out, s_in = streams(device, 2)

    def both() -> None:  # each copy on its own stream, both inside the current stream's events
        for stream, dst, src in ((s_out, host[0], dev[0]), (s_in, dev[1], host[1])):
            if stream is not None:
                stream.wait_stream(torch.cuda.current_stream(device))
            with on(stream):
                dst.copy_(src, non_blocking=True)
        for stream in (s_out, s_in):
            if stream is not None:
                torch.cuda.current_stream(device).wait_stream(stream)

    duplex = median(event_ms(device, both, reps, 3, inner))
    return {"d2h": d2h, "h2d": h2d, "duplex": duplex}


def duplex(
    engine: LMCacheEngine, store_reqs: list[Request], load_req: Request, device: torch.device
) -> list[float]:
    """Wall ms of storing ``store_reqs[i]`` on one thread while loading ``load_req`` here."""
    engine.clear()
    store_fn(engine, load_req)()
    s_store, s_load = streams(device, 2)
    times = []
    for req in store_reqs:
        gate = threading.Barrier(2)
        stored: list[int] = []

        def store(
            req: Request = req, gate: threading.Barrier = gate, out: list[int] = stored
        ) -> None:
            gate.wait()
            with on(s_store):
                out.append(store_fn(engine, req, s_store)())

        thread = threading.Thread(target=store)
        thread.start()
        sync(device)
        gate.wait()
        t = time.perf_counter()
        with on(s_load):
            loaded = load_fn(engine, load_req, s_load)()
        thread.join()
        sync(device)
        times.append((time.perf_counter() - t) * 1e3)
        if stored != [req.tokens.numel()] or not bool(loaded.all()):
            raise SystemExit(f"store while loading: stored {stored}, loaded {int(loaded.sum())}")
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


def gemm_slowdown(
    engine: LMCacheEngine, req: Request, device: torch.device, size: int, count: int
) -> tuple[float, float]:
    """(GEMM ms alone, before and after; GEMM ms while one thread stores and loads ``req``
    in a loop on its own stream)."""
    a = torch.randn(size, size, device=device, dtype=DTYPE)
    b = torch.randn(size, size, device=device, dtype=DTYPE)
    s_gemm, s_bg = streams(device, 2)
    stop, running = threading.Event(), threading.Event()
    failed: list[BaseException] = []

    def traffic() -> None:
        try:
            while not stop.is_set():
                engine.clear()
                with on(s_bg):
                    store_fn(engine, req, s_bg)()
                    load_fn(engine, req, s_bg)()
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


def print_table(title: str, rows: list[Row]) -> None:
    head: Row = ("row", "measured", "ceiling (same run)", "ratio", "target", None)
    cells = [(*r[:5], "" if r[5] is None else "met" if r[5] else "missed") for r in [head, *rows]]
    cells[0] = (*cells[0][:5], "")
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
        help="a 2-layer geometry, few samples (CPU without a GPU): checks the script",
    )
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        raise SystemExit("gpu_transfer.py needs a CUDA GPU (--smoke runs it on the CPU)")
    device = torch.device("cuda" if cuda else "cpu")
    reps = args.reps or (3 if args.smoke else 20 if args.quick else 30)
    layers, big, small = (2, 1024, 256) if args.smoke else (32, 16384, 256)
    gemm_size, gemm_count = (256, 10) if args.smoke else (8192, 100 if args.quick else 200)
    cache = Cache(device, layers, 2 * big + small + 4 * PAGE)
    a, b, s = cache.request(big, 1), cache.request(big, 2), cache.request(small, 3)
    gib = a.nbytes / 2**30
    name = torch.cuda.get_device_name() if cuda else "CPU (smoke)"
    print(
        f"{name}: {layers} layers, {HEADS} KV heads of {HEAD}, bf16, {PAGE}-token pages, "
        f"{reps} samples per figure",
        flush=True,
    )
    rows: list[Row] = []
    exact = {}

    # the first engine of the process: its first load against its later ones
    engine = cache.engine(1.25 * gib + 0.1, None)
    store_fn(engine, a)()
    first = wall_ms(device, load_fn(engine, a), 1, warmup=0)[0]
    later = median(wall_ms(device, load_fn(engine, a), reps))
    engine.close()
    print(f"first load {first:.2f} ms, later {later:.2f} ms", flush=True)

    engine = cache.engine(3.5 * gib + 0.1, None)  # the default config: checksums on (CUDA)
    for label, req, want in ((f"{big // 1024}k-token", a, 0.95), (f"{small}-token", s, 0.85)):
        exact[label] = bit_exact(cache, engine, req)
        st = median(wall_ms(device, store_fn(engine, req), reps, setup=engine.clear))
        ld = median(wall_ms(device, load_fn(engine, req), reps))
        ceil = ceilings(device, req.nbytes, reps)
        rows += transfer_rows(label, req, st, ld, ceil, want)
        print(f"{label}: store {st:.2f} ms, load {ld:.2f} ms, ceilings {ceil}", flush=True)
        if req is a:
            big_ceil, on = ceil, (st, ld)
    fresh = [replace(b, tokens=tokens(big, 100 + i)) for i in range(3 + reps)]
    both = median(duplex(engine, fresh, a, device)[3:])
    total = 2 * a.nbytes
    rows.append(
        (
            f"one engine storing one {big // 1024}k request while loading another",
            f"{gbs(total, both):.1f} GB/s ({both:.2f} ms)",
            f"duplex {gbs(total, big_ceil['duplex']):.1f} GB/s",
            f"{100 * big_ceil['duplex'] / both:.0f} %",
            ">= 90 GB/s",
            gbs(total, both) >= 90,
        )
    )
    alone, busy = gemm_slowdown(engine, a, device, gemm_size, gemm_count)
    on_device = engine.gpu_connector is not None and engine.gpu_connector.verifies_checksums
    engine.close()
    print(f"store while loading {both:.2f} ms; GEMM {alone:.3f} / {busy:.3f} ms", flush=True)

    engine = cache.engine(1.25 * gib + 0.1, False)
    off = (
        median(wall_ms(device, store_fn(engine, a), reps, setup=engine.clear)),
        median(wall_ms(device, load_fn(engine, a), reps)),
    )
    engine.close()
    default_on = LMCacheConfig().checksum_for(device.type, on_device)
    cost = max(1 - off[0] / on[0], 1 - off[1] / on[1])
    rows.append(
        (
            f"checksum on (default) vs off, {big // 1024}k store / load",
            f"{gbs(a.nbytes, on[0]):.1f} / {gbs(a.nbytes, on[1]):.1f} GB/s",
            f"off {gbs(a.nbytes, off[0]):.1f} / {gbs(a.nbytes, off[1]):.1f} GB/s",
            f"cost {100 * (1 - off[0] / on[0]):.1f} / {100 * (1 - off[1] / on[1]):.1f} %",
            f"on by default (now {'on' if default_on else 'off'}), <= 3 % cost",
            default_on and cost <= 0.03,
        )
    )
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
            f"first warm {big // 1024}k load after engine start",
            f"{first:.2f} ms",
            f"later loads {later:.2f} ms",
            f"{first / later:.2f}x",
            "<= 1.2x",
            first / later <= 1.2,
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
        f"lmcache on {name}: LMCacheEngine + vllm.{device.type}, Llama-8B KV geometry, "
        f"medians of {reps}",
        rows,
    )
    print("bit-exact reload: " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in exact.items()))
    return 0 if all(exact.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
