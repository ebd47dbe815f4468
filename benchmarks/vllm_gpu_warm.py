# SPDX-License-Identifier: Apache-2.0
"""Where a warm request's time goes: real vLLM with lmcache on a CUDA GPU, warm requests only.

Run on a CUDA machine with vLLM importable (as for ``vllm_gpu.py``)::

    python benchmarks/vllm_gpu_warm.py [--layers {8,32}] [--tokens 16384] [--reps 4]

One lmcache engine over the random Llama of ``vllm_gpu.py`` (Llama-3-8B attention geometry,
32 layers by default). It sends ``--reps`` new prompts (cold), the same again (vLLM's own
prefix-cache hit: the *floor*, one step), then empties vLLM's prefix cache and sends them once
more (*warm*: lmcache loads them). Per warm request it prints the TTFT, how long vLLM waited
for the lookup's answer, and whether the hit was copied to the GPU at lookup (within the
prefetch budget) or had to be checked through the scratch buffer and copied again at load.
Last, the median warm TTFT against the physical bound: the KV bytes over a pinned
host-to-device copy plus the floor's median, both measured in this run (target: at most 1.1x,
as in ``vllm_gpu.py``).
``--smoke`` checks the script on vLLM's CPU build (no prefetch there).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_gpu_runs as runs
from vllm_gpu import h2d_ceiling_ms
from vllm_gpu_runs import fresh_engine, ttft


def _instrument() -> tuple[list[bool], dict[str, float], dict[str, float]]:
    """Record, per lookup, whether its hit was copied at lookup, and per request when vLLM
    first asked and when the answer came."""
    from lmcache_vllm.scheduler.prefix_lookups import PrefixLookups
    from lmcache_vllm.worker.hit_prefetch import HitPrefetcher

    copied: list[bool] = []
    asked: dict[str, float] = {}
    answered: dict[str, float] = {}
    prefetch, ask = HitPrefetcher.prefetch, PrefixLookups.ask

    def _prefetch(self: HitPrefetcher, engine: Any, hit: Any) -> None:
        prefetch(self, engine, hit)
        copied.append(hit.prefetched is not None)

    def _ask(self: PrefixLookups, rid: str, query: Any) -> int | None:
        asked.setdefault(rid, time.perf_counter())
        got = ask(self, rid, query)
        if got is not None:
            answered.setdefault(rid, time.perf_counter())
        return got

    HitPrefetcher.prefetch = _prefetch  # type: ignore[method-assign]
    PrefixLookups.ask = _ask  # type: ignore[method-assign]
    return copied, asked, answered


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--layers", type=int, choices=(8, 32), default=32)
    parser.add_argument("--reps", type=int, default=4, help="prompts (warm requests)")
    parser.add_argument(
        "--smoke", action="store_true", help="2 layers, 1k tokens, vLLM's CPU build"
    )
    args = parser.parse_args()
    if args.smoke:
        args.tokens, args.layers, args.reps = min(args.tokens, 1024), 2, 2
    from lmcache_vllm.testing import build_tiny_llama, make_prompt

    geometry: dict[str, int] = (
        {"hidden_size": 256, "num_heads": 4, "num_kv_heads": 2, "head_dim": 64, "vocab_size": 1000}
        if args.smoke
        else {"hidden_size": 4096, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128}
    )
    geometry.setdefault("vocab_size", 32000)
    geometry["intermediate_size"] = 512 if args.smoke else 8192 if args.layers == 8 else 4096
    name = "smoke" if args.smoke else "llama3-8b-geometry"
    folder = Path(tempfile.gettempdir()) / "lmcache-bench" / f"{name}-l{args.layers}"
    model = build_tiny_llama(
        folder, num_layers=args.layers, max_position_embeddings=args.tokens + 1024, **geometry
    )
    vocab = geometry["vocab_size"]
    prompts = [make_prompt(args.tokens, seed=100 + i, vocab_size=vocab) for i in range(args.reps)]
    kv_bytes = args.tokens * args.layers * 2 * geometry["num_kv_heads"] * geometry["head_dim"] * 2
    h2d_ms = h2d_ceiling_ms(kv_bytes)
    runs.ENGINE_MEMORY = 0.3 if args.layers > 8 else 0.1
    pool_gib = max(8.0, args.reps * kv_bytes / 2**30 + 1)
    kv = {
        "kv_connector": "LMCacheConnectorV1",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"lmcache.max_local_cpu_size": pool_gib},
    }
    copied, asked, answered = _instrument()
    with fresh_engine("lmcache", model, kv, args.tokens + 64) as llm:
        ttft(llm, make_prompt(512, seed=99, vocab_size=vocab))  # warm-up (distinct tokens)
        cold = [ttft(llm, p)[0] for p in prompts]
        floor = [ttft(llm, p)[0] for p in prompts]
        llm.reset_prefix_cache()
        copied.clear()
        asked.clear()
        answered.clear()
        warm = [ttft(llm, p)[0] for p in prompts]
    waits = [1e3 * (answered[r] - asked[r]) for r in asked if r in answered]
    print("=== warm requests, lmcache default config")
    print("cold TTFT (ms):  " + " ".join(f"{1e3 * t:.1f}" for t in cold))
    print("floor (ms):      " + " ".join(f"{1e3 * t:.1f}" for t in floor))
    print("warm TTFT (ms):  " + " ".join(f"{1e3 * t:.1f}" for t in warm))
    print("lookup wait (ms): " + " ".join(f"{w:.1f}" for w in waits))
    print(f"hits copied to the GPU at lookup: {sum(copied)} of {len(copied)}")
    bound = h2d_ms + 1e3 * statistics.median(floor)
    ratio = 1e3 * statistics.median(warm) / bound
    print(
        f"warm median {1e3 * statistics.median(warm):.1f} ms against the bound {bound:.1f} ms "
        f"({h2d_ms:.1f} h2d + {1e3 * statistics.median(floor):.1f} floor): {ratio:.2f}x "
        f"(target <= 1.1x: {'met' if ratio <= 1.1 else 'missed'})"
    )


if __name__ == "__main__":
    main()
