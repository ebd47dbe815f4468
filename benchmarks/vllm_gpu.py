# SPDX-License-Identifier: Apache-2.0
"""Real vLLM on a CUDA GPU with and without lmcache: cold and warm TTFT, throughput at 0 % reuse.

Run on a CUDA machine with vLLM importable (offline: ``tools/gpu_engines/README.md``)::

    python benchmarks/vllm_gpu.py [--tokens 16384] [--reps 5] [--checksum-off]

Model: a random 8-layer Llama with Llama-3-8B attention geometry (hidden 4096, 32 query heads,
8 KV heads of 128, bf16; 16k tokens = 512 MiB of KV), built locally. Engines run one after the
other in this process, eager mode, 16-token blocks. Per engine (no lmcache, then lmcache with
the given config, its host pool pinned before timing):

- ``cold``: TTFT (``max_tokens=1`` wall time) of a prompt never seen, median over ``--reps``;
- ``warm``: the same prompts again after ``reset_prefix_cache()`` (vLLM's own cache emptied:
  without lmcache that is a recompute, with lmcache a load);
- ``throughput``: prompt tokens per second for a batch of distinct 2k-token prompts (0 % reuse).

Targets printed next to the figures: cold within +2 %, throughput at least 99 % of no-lmcache,
warm at least 3x faster than recompute.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")


def _engine(model: Path, kv: dict[str, Any] | None, max_len: int) -> Any:
    from vllm import LLM

    return LLM(
        model=str(model),
        enforce_eager=True,
        block_size=16,
        gpu_memory_utilization=0.3,  # two engines in turn: the first may not free at once
        dtype="bfloat16",
        max_model_len=max_len,
        max_num_batched_tokens=max_len,
        seed=0,
        kv_transfer_config=kv,
    )


def _shutdown(llm: Any) -> None:
    from lmcache_vllm.testing import shutdown_llm

    shutdown_llm(llm)


def _ttft(llm: Any, prompt: list[int]) -> float:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
    return time.perf_counter() - start


def _throughput(llm: Any, prompts: list[list[int]]) -> float:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return sum(len(p) for p in prompts) / (time.perf_counter() - start)


def _measure(llm: Any, prompts: list[list[int]], batch: list[list[int]]) -> dict[str, float]:
    _ttft(llm, prompts[-1][:512])  # warm-up (distinct tokens)
    cold = [_ttft(llm, p) for p in prompts[:-1]]
    llm.reset_prefix_cache()
    warm = [_ttft(llm, p) for p in prompts[:-1]]
    tput = _throughput(llm, batch)
    return {"cold": statistics.median(cold), "warm": statistics.median(warm), "tput": tput}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32, help="2k-token prompts per batch")
    parser.add_argument("--checksum-off", action="store_true", help="lmcache checksum: false")
    parser.add_argument(
        "--sync-saves",
        action="store_true",
        help="for comparison: run each save inline in wait_for_save (copy + commit, as before "
        "saves went off the step)",
    )
    args = parser.parse_args()
    if args.sync_saves:
        from lmcache_vllm.save_queue import SaveQueue

        def _inline(self: SaveQueue, req_id: str, copy: Any) -> None:
            commit = copy()
            if callable(commit):
                commit()

        SaveQueue.submit = _inline  # type: ignore[method-assign]

    import torch

    from lmcache.tiers import reset_process_cpu_tiers
    from lmcache_vllm.testing import build_tiny_llama, make_prompt
    from lmcache_vllm.vllm_v1_adapter import live_engines

    if not torch.cuda.is_available():
        raise SystemExit("vllm_gpu.py needs a CUDA GPU")
    import vllm

    folder = Path(tempfile.gettempdir()) / "lmcache-bench" / "llama3-8b-geometry-l8"
    model = build_tiny_llama(
        folder,
        hidden_size=4096,
        num_layers=8,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        vocab_size=32000,
        max_position_embeddings=args.tokens + 1024,
        intermediate_size=8192,
    )
    prompts = [
        make_prompt(args.tokens, seed=100 + i, vocab_size=32000) for i in range(args.reps + 1)
    ]
    batch = [make_prompt(2048, seed=1000 + i, vocab_size=32000) for i in range(args.batch)]
    max_len = args.tokens + 64
    print(
        f"{torch.cuda.get_device_name()}, vLLM {vllm.__version__}, random Llama: 8 layers, "
        f"Llama-3-8B attention (32 q / 8 kv heads of 128), bf16, prompt {args.tokens} tokens"
    )

    base_llm = _engine(model, None, max_len)
    try:
        base = _measure(base_llm, prompts, batch)
    finally:
        _shutdown(base_llm)

    reset_process_cpu_tiers()
    extra: dict[str, Any] = {"lmcache.max_local_cpu_size": 8.0}
    if args.checksum_off:
        extra["lmcache.checksum"] = False
    kv = {
        "kv_connector": "LMCacheConnectorV1",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }
    lm_llm = _engine(model, kv, max_len)
    try:
        for engine in live_engines():
            engine.pool.wait_prepinned(timeout=300)  # pinning is not what this measures
        lm = _measure(lm_llm, prompts, batch)
        for engine in live_engines():
            m = engine.metrics
            names = (
                "stored_chunks",
                "hit_tokens",
                "loaded_chunks",
                "evicted_chunks",
                "failed_allocations",
                "checksum_failures",
                "tier_errors",
            )
            print("lmcache:", ", ".join(f"{n}={m.value(n):.0f}" for n in names))
    finally:
        _shutdown(lm_llm)

    cold_pct = 100 * (lm["cold"] / base["cold"] - 1)
    tput_pct = 100 * lm["tput"] / base["tput"]
    speedup = base["warm"] / lm["warm"]
    ok = {True: "met", False: "MISSED"}
    print(f"\n{'':<34} {'no lmcache':>11} {'lmcache':>11}  target")
    print(
        f"{'cold TTFT (ms)':<34} {1e3 * base['cold']:>11.1f} {1e3 * lm['cold']:>11.1f}  "
        f"<= +2 %: {cold_pct:+.1f} % {ok[cold_pct <= 2]}"
    )
    print(
        f"{'warm TTFT after reset (ms)':<34} {1e3 * base['warm']:>11.1f} {1e3 * lm['warm']:>11.1f}  "
        f">= 3x faster: {speedup:.2f}x {ok[speedup >= 3]}"
    )
    print(
        f"{'throughput, 0 % reuse (tok/s)':<34} {base['tput']:>11.0f} {lm['tput']:>11.0f}  "
        f">= 99 %: {tput_pct:.1f} % {ok[tput_pct >= 99]}"
    )
    print(
        f"checksum: {'off' if args.checksum_off else 'on (default)'}; saves: "
        f"{'inline (synchronous)' if args.sync_saves else 'off the step (default)'}"
    )


if __name__ == "__main__":
    main()
