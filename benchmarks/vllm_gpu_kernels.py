# SPDX-License-Identifier: Apache-2.0
"""What each kernel implementation gives a vLLM user: cold and warm TTFT per implementation.

Run on a CUDA machine with vLLM importable (as for ``vllm_gpu.py``)::

    python benchmarks/vllm_gpu_kernels.py [--layers {8,32}] [--tokens 16384] [--reps 3]
        [--rows base,wheel,jit,nobinary] [--cuda-home /usr/local/cuda]

Each row runs in a process of its own, since which kernels serve lmcache is decided once per
process. Rows:

- ``base``: vLLM alone (a warm request is a recompute);
- ``wheel``: lmcache with the compiled kernels of the installed wheel (no compiler needed);
- ``jit``: lmcache with the kernels built on this machine (``LMCACHE_JIT=1``; nvcc from
  ``--cuda-home``, made visible to this row only);
- ``nobinary``: lmcache without any binary (``LMCACHE_DISABLE_CEXT=1``): what a GPU the wheel
  holds no code for gets.

Per row: one engine over the random Llama of ``vllm_gpu.py`` (Llama-3-8B attention geometry),
``--reps`` new prompts (cold TTFT), then ``reset_prefix_cache()`` and the same prompts again
(warm: lmcache loads them). The table prints the medians, the first and second warm request, and
which implementation served the row, with the targets: JIT warm within 3 % of the wheel's, no
binary at most 1.5x the wheel's, cold within +2 % of vLLM alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROWS = ("wheel", "jit", "nobinary", "base")


def _child(row: str, model: Path, tokens: int, reps: int, layers: int) -> dict[str, Any]:
    """One engine of ``row``: cold TTFTs, then warm TTFTs after a reset (in this process)."""
    import vllm_gpu_runs as runs
    from vllm_gpu_runs import fresh_engine, ttft

    from lmcache_vllm.testing import make_prompt

    runs.ENGINE_MEMORY = 0.3 if layers > 8 else 0.1
    kv: dict[str, Any] = {}
    if row != "base":
        kv = {
            "kv_connector": "LMCacheConnectorV1",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.max_local_cpu_size": 8.0},
        }
    prompts = [make_prompt(tokens, seed=300 + i, vocab_size=32000) for i in range(reps)]
    with fresh_engine("base" if row == "base" else "lmcache", model, kv, tokens + 64) as llm:
        ttft(llm, make_prompt(512, seed=299, vocab_size=32000))  # warm-up, distinct tokens
        cold = [ttft(llm, p)[0] for p in prompts]
        llm.reset_prefix_cache()
        warm = [ttft(llm, p)[0] for p in prompts]
    import torch

    from lmcache import gpu_ops

    impl = "vLLM alone" if row == "base" else gpu_ops.implementation(torch.device("cuda"))
    return {"row": row, "cold": cold, "warm": warm, "impl": impl}


def _env(row: str, cuda_home: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LMCACHE_JIT", "LMCACHE_DISABLE_CEXT")}
    env["LMCACHE_JIT"] = "0"
    if row == "jit":
        if cuda_home is None:
            raise SystemExit("the jit row needs --cuda-home (where bin/nvcc is)")
        env["LMCACHE_JIT"] = "1"
        env["CUDA_HOME"] = cuda_home
        env["PATH"] = f"{cuda_home}/bin:{env.get('PATH', '')}"
    elif row == "nobinary":
        env["LMCACHE_DISABLE_CEXT"] = "1"
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--layers", type=int, choices=(2, 8, 32), default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--cuda-home", default=None, help="toolkit for the jit row")
    parser.add_argument(
        "--smoke", action="store_true", help="2 layers, 1k tokens, rows base and nobinary (CPU)"
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        args.tokens, args.layers, args.rows = min(args.tokens, 1024), 2, "base,nobinary"
    if args.child:
        result = _child(args.child, Path(args.model), args.tokens, args.reps, args.layers)
        print("RESULT " + json.dumps(result), flush=True)
        return
    from lmcache_vllm.testing import build_tiny_llama

    geometry = (
        {
            "hidden_size": 256,
            "num_heads": 4,
            "num_kv_heads": 2,
            "head_dim": 64,
            "intermediate_size": 512,
        }
        if args.smoke
        else {
            "hidden_size": 4096,
            "num_heads": 32,
            "num_kv_heads": 8,
            "head_dim": 128,
            "intermediate_size": 8192 if args.layers == 8 else 4096,
        }
    )
    name = "smoke" if args.smoke else "llama3-8b-geometry"
    folder = Path(tempfile.gettempdir()) / "lmcache-bench" / f"{name}-l{args.layers}"
    model = build_tiny_llama(
        folder,
        num_layers=args.layers,
        max_position_embeddings=args.tokens + 1024,
        vocab_size=32000,
        **geometry,
    )
    results: dict[str, dict[str, Any]] = {}
    for row in args.rows.split(","):
        cmd = [sys.executable, __file__, "--child", row, "--model", str(model)]
        cmd += [
            "--tokens",
            str(args.tokens),
            "--reps",
            str(args.reps),
            "--layers",
            str(args.layers),
        ]
        done = subprocess.run(cmd, env=_env(row, args.cuda_home), capture_output=True, text=True)
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
        if done.returncode != 0 or not lines:
            print(f"row {row} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
            continue
        results[row] = json.loads(lines[-1][len("RESULT ") :])
        print(f"row {row}: {results[row]}", flush=True)  # kept if a time limit cuts the run
    _table(results, args)


def _table(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"=== vLLM, {args.layers} layers, {args.tokens}-token prompts, {args.reps} each")
    print(f"{'row':<9} {'cold (ms)':>10} {'warm 1st':>9} {'warm 2nd':>9} {'warm med':>9}  kernels")
    med: dict[str, tuple[float, float]] = {}
    for row, r in results.items():
        cold, warm = statistics.median(r["cold"]), statistics.median(r["warm"])
        med[row] = (1e3 * cold, 1e3 * warm)
        second = r["warm"][1] if len(r["warm"]) > 1 else float("nan")
        print(
            f"{row:<9} {1e3 * cold:>10.1f} {1e3 * r['warm'][0]:>9.1f} {1e3 * second:>9.1f} "
            f"{1e3 * warm:>9.1f}  {r['impl']}"
        )
    if "wheel" in med:
        wheel = med["wheel"][1]
        checks = [
            ("jit", 1.03, "JIT warm within 3 % of the wheel's"),
            ("nobinary", 1.5, "no-binary warm at most 1.5x the wheel's"),
        ]
        for row, limit, what in checks:
            if row in med:
                ratio = med[row][1] / wheel
                print(f"{what}: {ratio:.2f}x ({'met' if ratio <= limit else 'missed'})")
    if "base" in med:
        for row in ("wheel", "jit", "nobinary"):
            if row in med:
                cost = 100 * (med[row][0] / med["base"][0] - 1)
                print(
                    f"{row} cold against vLLM alone: {cost:+.1f} % ({'met' if cost <= 2 else 'missed'})"
                )


if __name__ == "__main__":
    main()
