# SPDX-License-Identifier: Apache-2.0
"""How long a save holds vLLM's step: the connector's worker side on a CUDA GPU.

Run on a CUDA machine (``python benchmarks/vllm_save_overlap.py``). Drives
``lmcache_vllm.worker.side.WorkerSide`` exactly as vLLM does (``bind_connector_metadata``,
``start_load_kv``, the per-layer hooks, ``wait_for_save``) over caches in vLLM's CUDA layout,
Llama-8B geometry (32 layers, 8 KV heads of 128, bf16, 16-token pages, shuffled), with the
6 GiB host pool pinned before timing. Per request size it prints, medians over ``--reps``:

- ``sync store``: ``LMCacheEngine.store`` of the request (what a synchronous ``wait_for_save``
  held the step for before saves went off the step);
- ``wait_for_save``: how long the hook now holds the host (queueing the save);
- ``next step waits``: how long the next step's ``bind_connector_metadata`` waits for the save's
  copy out of vLLM's pages, after ``--step-ms`` of simulated compute (the GPU busy with matmuls);
- ``visible after``: from ``wait_for_save`` until the chunks are checksummed and visible;
- ``layerwise store``: host time of the ``save_kv_layer`` hooks + ``wait_for_save`` in layerwise
  mode, summed over the layers; ``lw next step waits``: as ``next step waits``, after a
  layerwise save;
- ``batched load`` / ``layerwise load``: a hit of the whole request, from the worker's lookup
  (what vLLM's scheduler calls first: it leases the hit and starts copying it to the device)
  until every layer is in vLLM's pages (layerwise: every layer is enqueued at ``start_load_kv``
  and the forward waits per layer on the device);
- ``no lease``: the same loads from ``start_load_kv`` alone, without a lookup first (a hit whose
  lease was lost: the load looks the chunks up and copies them itself);
- the pinned device-to-host ceiling for the same bytes, measured in the same run (device time
  between CUDA events).

It first checks that what was saved loads back bit for bit (poisoned pages).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
from typing import Any

import torch

from lmcache.gpu_connector import TransferSpec
from lmcache.tiers import reset_process_cpu_tiers
from lmcache_vllm.connector_metadata import LMCacheConnectorMetadata, LoadSpec, ReqMeta, SaveSpec
from lmcache_vllm.lookup_sockets import engine_key
from lmcache_vllm.lookup_wire import LookupQuery
from lmcache_vllm.testing import connector_vllm_config
from lmcache_vllm.transfer.transfer_plan import slot_mapping
from lmcache_vllm.vllm_v1_adapter import load_lmcache_config
from lmcache_vllm.worker.side import WorkerSide

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _common import event_ms, median

LAYERS, HEADS, HEAD, PAGE, CHUNK = 32, 8, 128, 16, 256
DTYPE = torch.bfloat16


def _vllm_config(layerwise: bool, checksum: bool) -> Any:
    return connector_vllm_config(
        engine_id=f"bench-{time.time_ns()}",
        block_size=PAGE,
        head_size=HEAD,
        model="bench/llama-8b",
        dtype="bfloat16",
        extra_config={
            "lmcache.chunk_size": CHUNK,
            "lmcache.max_local_cpu_size": 6.0,
            "lmcache.use_layerwise": layerwise,
            "lmcache.checksum": checksum,
        },
    )


class Bench:
    def __init__(self, num_blocks: int, layerwise: bool, checksum: bool) -> None:
        reset_process_cpu_tiers()
        vc = _vllm_config(layerwise, checksum)
        self.meta = LMCacheConnectorMetadata()
        self.worker = WorkerSide(
            vc, load_lmcache_config(vc), engine_key(vc), 1, 0, lambda: self.meta
        )
        raw = torch.randn(LAYERS, num_blocks, PAGE, HEADS, 2 * HEAD, device="cuda", dtype=DTYPE)
        self.raw = raw
        self.caches = {
            f"model.layers.{i}.self_attn.attn": raw[i].permute(0, 2, 1, 3) for i in range(LAYERS)
        }
        self.worker.register_kv_caches(self.caches)
        self.num_blocks = num_blocks
        self.a = torch.randn(4096, 4096, device="cuda", dtype=DTYPE)
        self._grow_pool()

    def _grow_pool(self) -> None:
        """Wait until the host pool's budget is pinned (a background thread pins it from the
        pool's creation on): pinning is measured elsewhere, not here."""
        engine = self.worker.lmcache_engine
        assert engine is not None
        if not engine.pool.wait_prepinned(timeout=300):
            raise SystemExit("the host pool was not pinned within 300 s")

    def busy(self, ms: float) -> None:
        """Queue about ``ms`` of GPU work on the current stream (the step's compute)."""
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        self.a @ self.a
        end.record()
        end.synchronize()
        per = max(start.elapsed_time(end), 1e-3)
        for _ in range(max(1, int(ms / per))):
            self.a @ self.a

    def step(self, *reqs: ReqMeta) -> tuple[float, float]:
        """One step; returns (host ms in the save hooks, host ms in bind)."""
        self.meta = LMCacheConnectorMetadata(requests=list(reqs))
        t0 = time.perf_counter()
        self.worker.bind(self.meta)
        t_bind = time.perf_counter() - t0
        self.worker.start_load_kv()
        t_save = 0.0
        for name in self.caches:
            self.worker.wait_for_layer_load(name)
            t1 = time.perf_counter()
            self.worker.save_kv_layer(name)
            t_save += time.perf_counter() - t1
        t1 = time.perf_counter()
        self.worker.wait_for_save()
        t_save += time.perf_counter() - t1
        return t_save * 1e3, t_bind * 1e3

    def request(self, n: int, seed: int) -> tuple[list[int], list[int]]:
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, 100_000, (n,), generator=g).tolist()
        blocks = (torch.randperm(self.num_blocks - 1, generator=g)[: -(-n // PAGE)] + 1).tolist()
        return tokens, blocks

    def close(self) -> None:
        self.worker.shutdown()
        reset_process_cpu_tiers()


def timed_load(bench: Bench, tokens: list[int], blocks: list[int], rid: str, lookup: bool) -> float:
    """Milliseconds from the lookup (or from ``start_load_kv`` when ``lookup`` is false) until
    every layer of the hit is in the pages (the forward's per-layer waits are device-side)."""
    load = LoadSpec(vllm_cached=0, lmcache_hit=len(tokens), load_end=len(tokens) - PAGE)
    meta = LMCacheConnectorMetadata(requests=[ReqMeta(rid, tokens, blocks, load=load)])
    torch.cuda.synchronize()
    t = time.perf_counter()
    if lookup:
        bench.worker._lookup(LookupQuery(rid, tokens))
    bench.meta = meta
    bench.worker.bind(meta)
    if not lookup:
        torch.cuda.synchronize()
        t = time.perf_counter()
    bench.worker.start_load_kv()
    for name in bench.caches:
        bench.worker.wait_for_layer_load(name)
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t) * 1e3
    bench.worker.wait_for_save()
    return ms


def run(n: int, reps: int, step_ms: float, checksum: bool) -> dict[str, float | bool]:
    num_blocks = 2 * n // PAGE + 8
    bench = Bench(num_blocks, layerwise=False, checksum=checksum)
    engine = bench.worker.lmcache_engine
    assert engine is not None
    nbytes = n * LAYERS * HEADS * 2 * HEAD * 2
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    ceil = event_ms(torch.device("cuda"), lambda: host.copy_(dev, non_blocking=True), reps)

    # correctness: save, poison, load, compare
    tokens, blocks = bench.request(n, 0)
    want = torch.stack([c[blocks] for c in bench.caches.values()]).clone()
    bench.step(ReqMeta("w", tokens, blocks, save=SaveSpec(0, n)))
    bench.worker._saves.wait(60)
    for c in bench.caches.values():
        c[blocks] = float("nan")
    load = LoadSpec(vllm_cached=0, lmcache_hit=n, load_end=n - PAGE)
    bench.step(ReqMeta("r", tokens, blocks, load=load))
    torch.cuda.synchronize()
    got = torch.stack([c[blocks] for c in bench.caches.values()])
    full = (n - PAGE) // PAGE
    exact = torch.equal(got[:, :full].view(torch.int16), want[:, :full].view(torch.int16))

    sync, hook, fence, visible = [], [], [], []
    for i in range(reps):
        tokens, blocks = bench.request(n, 100 + i)
        torch.cuda.synchronize()
        t = time.perf_counter()
        engine.store(tokens, None, TransferSpec(slot_mapping(blocks, PAGE, n)))
        sync.append((time.perf_counter() - t) * 1e3)
        tokens, blocks = bench.request(n, 1000 + i)
        bench.busy(step_ms)  # the step that wrote this KV
        t = time.perf_counter()
        save_ms, _ = bench.step(ReqMeta(f"s{i}", tokens, blocks, save=SaveSpec(0, n)))
        hook.append(save_ms)
        bench.busy(step_ms)  # the next step's host-side scheduling + compute queued
        _, bind_ms = bench.step()
        fence.append(bind_ms)
        bench.worker._saves.wait(60)
        visible.append((time.perf_counter() - t) * 1e3)
    bench.close()

    # loads of a hit, batched and layerwise: from the lookup (vLLM's path: the lookup leases
    # the hit and starts its copy to the device) or from start_load_kv alone (no lease)
    load_ms: dict[tuple[bool, bool], list[float]] = {}
    layer_ms, layer_fence = [], []
    for layerwise in (False, True):
        lb = Bench(num_blocks, layerwise=layerwise, checksum=checksum)
        for i in range(reps):
            tokens, blocks = lb.request(n, 5000 + i)
            if layerwise:
                lb.busy(step_ms)
            save_ms, _ = lb.step(ReqMeta(f"l{i}", tokens, blocks, save=SaveSpec(0, n)))
            if layerwise:
                layer_ms.append(save_ms)
                lb.busy(step_ms)
            _, bind_ms = lb.step()
            if layerwise:
                layer_fence.append(bind_ms)
            lb.worker._saves.wait(60)
            for lookup in (True, False):
                load_ms.setdefault((layerwise, lookup), []).append(
                    timed_load(lb, tokens, blocks, f"q{i}{lookup}", lookup)
                )
        lb.close()
    return {
        "n": n,
        "mib": nbytes / 2**20,
        "ceil_ms": median(ceil),
        "sync_ms": median(sync),
        "hook_ms": median(hook),
        "fence_ms": median(fence),
        "visible_ms": median(visible),
        "layerwise_ms": median(layer_ms),
        "layerwise_fence_ms": median(layer_fence),
        "load_ms": median(load_ms[False, True]),
        "lw_load_ms": median(load_ms[True, True]),
        "load_nolease_ms": median(load_ms[False, False]),
        "lw_load_nolease_ms": median(load_ms[True, False]),
        "exact": exact,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--checksum", action="store_true", help="lmcache's default checksums on")
    parser.add_argument(
        "--growth",
        type=int,
        default=None,
        help="layerwise load groups grow by this factor (default: the connector's)",
    )
    args = parser.parse_args()
    if args.growth is not None:
        import functools

        from lmcache_vllm.worker import hit_prefetch, layerwise_step

        groups = functools.partial(layerwise_step.layer_groups, growth=args.growth)
        layerwise_step.layer_groups = groups  # type: ignore[assignment]
        hit_prefetch.layer_groups = groups  # type: ignore[assignment]
    if not torch.cuda.is_available():
        raise SystemExit("vllm_save_overlap.py needs a CUDA GPU")
    print(
        f"{torch.cuda.get_device_name()}, Llama-8B KV geometry, bf16, pages of {PAGE}, "
        f"checksum={'on' if args.checksum else 'off'}, simulated step {args.step_ms:.0f} ms"
    )
    print(
        f"{'tokens':>7} {'MiB':>7} {'d2h ceil ms':>11} {'sync store ms':>13} "
        f"{'wait_for_save ms':>16} {'next step waits ms':>18} {'visible after ms':>16} "
        f"{'layerwise store ms':>18} {'lw next step waits ms':>21} {'batched load ms':>15} {'layerwise load ms':>17} "
        f"{'no lease: batched ms':>20} {'layerwise ms':>12} {'bit-exact':>9}"
    )
    for n in args.tokens:
        r = run(n, args.reps, args.step_ms, args.checksum)
        print(
            f"{r['n']:>7} {r['mib']:>7.0f} {r['ceil_ms']:>11.1f} {r['sync_ms']:>13.1f} "
            f"{r['hook_ms']:>16.2f} {r['fence_ms']:>18.2f} {r['visible_ms']:>16.1f} "
            f"{r['layerwise_ms']:>18.2f} {r['layerwise_fence_ms']:>21.2f} {r['load_ms']:>15.2f} {r['lw_load_ms']:>17.2f} "
            f"{r['load_nolease_ms']:>20.2f} {r['lw_load_nolease_ms']:>12.2f} "
            f"{'yes' if r['exact'] else 'NO':>9}"
        )


if __name__ == "__main__":
    main()
