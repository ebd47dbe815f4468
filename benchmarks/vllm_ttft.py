# SPDX-License-Identifier: Apache-2.0
"""TTFT and throughput of real vLLM (CPU) with lmcache, without a connector, and with ExampleConnector.

``nox -s bench`` runs it. Each configuration runs in its own child process (one vLLM at a time; fresh
Prometheus registry, fresh lmcache state), on the demo model of ``vllm_demo.py`` (random Llama, 8
layers, hidden 1024, 2 KV heads of 128, bf16):

* ``none``    -- vLLM without a KV connector. Per prompt size: **recompute TTFT** (a prompt vLLM has
  never seen) and the **floor** (the same prompt again, served by vLLM's own prefix cache: the TTFT
  with no prefill left, i.e. the best any external cache could reach).
* ``lmcache`` -- lmcache's CPU tier. **store TTFT** (first time: recompute + save) and, after
  ``llm.reset_prefix_cache()`` (vLLM's cache emptied, the connector's kept), **warm TTFT** (loaded).
* ``example`` -- vLLM's in-tree ``ExampleConnector`` (safetensors files under a temp dir), same steps.
* throughput with 0 % reuse: a batch of distinct prompts (nothing to hit) with and without a connector,
  (prompt + generated) tokens per second.

TTFT is vLLM's ``RequestOutput.metrics.first_token_latency`` of a ``max_tokens=1`` request. Each
size uses ``--reps`` prompts (the same prompts in every configuration); each prompt is stored once
and then served ``--warm-reps`` times (each after ``reset_prefix_cache()``). Figures are the best
(minimum) over repetitions: other load on a shared machine only ever adds time. **Load time** is the time spent inside the worker-side connector's load calls
(``start_load_kv`` + ``wait_for_layer_load``), timed by wrapping them (single-process mode, the
default here); under ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` it falls back to warm TTFT - floor.

Targets (printed next to the figures, with MISSED when missed; the script still exits 0):
cached TTFT <= 1/5 of recompute at 4k tokens; lmcache loads >= 3x faster than ExampleConnector
(load time as above); < 2 % throughput loss at 0 % reuse. The exit status is non-zero only when a run
fails (an engine error, or a connector that loads nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _common import (
    DEMO_MODEL,
    REPO_ROOT,
    SMOKE_MODEL,
    ConnectorTimer,
    build_model,
    lmcache_transfer_config,
    log,
    quiet_third_party,
    run_prompt,
    start_engine,
)
from vllm_ttft_report import CONFIGS, report

# --------------------------------------------------------------------------------------------------
# child process: one configuration
# --------------------------------------------------------------------------------------------------


def prompt_for(n: int, rep: int, vocab: int) -> list[int]:
    from lmcache_vllm.testing import make_prompt

    return make_prompt(n, seed=100_000 + 1000 * rep + n, vocab_size=vocab)


def fmt_s(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1e3:.1f} ms"


def kv_config(config: str, via: str, storage: str) -> dict[str, Any] | None:
    if config == "none":
        return None
    if config == "lmcache":
        return lmcache_transfer_config(via)
    if config == "example":
        return {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": storage},
        }
    raise ValueError(f"unknown config {config!r}; expected one of {CONFIGS}")


def throughput(
    llm: Any, n_prompts: int, n_tokens: int, max_tokens: int, seed: int, vocab: int
) -> dict[str, float]:
    """One batch of distinct prompts (0 % reuse): (prompt + generated) tokens per second."""
    from vllm import SamplingParams

    from lmcache_vllm.testing import make_prompt

    prompts = [
        {"prompt_token_ids": make_prompt(n_tokens, seed=seed + i, vocab_size=vocab)}
        for i in range(n_prompts)
    ]
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    hits = sum(int(o.num_cached_tokens or 0) for o in outs)
    return {
        "wall_s": wall,
        "tokens": n_prompts * n_tokens + gen,
        "tok_per_s": (n_prompts * n_tokens + gen) / wall,
        "cpu_s": cpu,
        "tok_per_cpu_s": (n_prompts * n_tokens + gen) / cpu,
        "cached_tokens": hits,
    }


def run_config(args: argparse.Namespace) -> dict[str, Any]:
    params = SMOKE_MODEL if args.tiny else DEMO_MODEL
    vocab = params["vocab_size"]
    model = build_model(params, args.model_root)
    max_len = max(args.sizes) + 256
    with tempfile.TemporaryDirectory(prefix="lmcache-bench-example-") as storage:
        kv_cfg = kv_config(args.worker, args.via, storage)
        t0 = time.perf_counter()
        llm = start_engine(model, max_len, kv_cfg)
        log(f"[{args.worker}] engine ready in {time.perf_counter() - t0:.1f} s")
        timer = ConnectorTimer()
        timer.install()
        res: dict[str, Any] = {
            "config": args.worker,
            "kv_transfer_config": kv_cfg,
            "ttft": {},
            "throughput": [],
        }
        # Warm-up: first-call costs, and for a connector one store + load round trip.
        warm_prompt = prompt_for(512, 999, vocab)
        run_prompt(llm, warm_prompt, 1)
        llm.reset_prefix_cache()
        run_prompt(llm, warm_prompt, 1)

        for n in args.sizes if args.ttft else []:
            rows = []
            for rep in range(args.reps):
                prompt = prompt_for(n, rep, vocab)
                llm.reset_prefix_cache()
                first = run_prompt(llm, prompt, 1, timer)
                row: dict[str, Any] = {
                    "first_ttft": first.ttft_s,
                    "first_token": first.token_ids,
                    "first_cached": first.num_cached_tokens,
                    "first_save_s": first.connector_save_s,
                }
                # The warm run (or, without a connector, the floor) repeats cheaply: no recompute.
                agains = []
                for _ in range(args.warm_reps):
                    if args.worker != "none" and not llm.reset_prefix_cache():
                        raise RuntimeError(
                            "vLLM refused reset_prefix_cache(); the warm run would be served "
                            "by vLLM, not by the connector"
                        )
                    agains.append(run_prompt(llm, prompt, 1, timer))
                again = min(agains, key=lambda r: r.ttft_s)
                loads = [a.connector_load_s for a in agains if a.connector_load_s is not None]
                row.update(
                    again_ttft=again.ttft_s,
                    again_ttfts=[a.ttft_s for a in agains],
                    again_token=again.token_ids,
                    again_tokens_same=all(a.token_ids == again.token_ids for a in agains),
                    again_cached=min(a.num_cached_tokens for a in agains),
                    again_external=min(a.external_hits for a in agains),
                    again_local=max(a.local_hits for a in agains),
                    again_load_s=min(loads) if loads else None,
                    again_loads_s=loads,
                )
                rows.append(row)
                log(
                    f"[{args.worker}] {n} tokens rep {rep}: first {first.ttft_s * 1e3:.0f} ms, "
                    f"again (best of {args.warm_reps}) {again.ttft_s * 1e3:.0f} ms (cached "
                    f"{row['again_cached']}, external {row['again_external']}, local "
                    f"{row['again_local']}); in connector: save {fmt_s(first.connector_save_s)}, "
                    f"load {fmt_s(row['again_load_s'])}"
                )
            res["ttft"][str(n)] = rows

        if args.tput_prompts > 0:
            llm.reset_prefix_cache()
            # The same distinct prompts in every configuration and round: nothing to reuse.
            t = throughput(
                llm,
                args.tput_prompts,
                args.tput_tokens,
                args.tput_max_tokens,
                seed=500_000,
                vocab=vocab,
            )
            res["throughput"].append(t)
            log(
                f"[{args.worker}] throughput: {t['tok_per_s']:.0f} tok/s, "
                f"{t['tok_per_cpu_s']:.0f} tok per CPU-s ({t['tokens']} tokens in "
                f"{t['wall_s']:.1f} s, {t['cpu_s']:.1f} CPU-s, cached {t['cached_tokens']})"
            )
        del llm
    return res


# --------------------------------------------------------------------------------------------------
# parent process: run the configurations, print the table
# --------------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="short run: 1 prompt per size, 3 warm runs, one throughput round of 8 prompts (~1.5 min)",
    )
    ap.add_argument(
        "--tiny",
        action="store_true",
        help="2-layer model instead of the demo model (for testing the script itself)",
    )
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument(
        "--reps",
        type=int,
        default=None,
        help="prompts per size, each stored once (default 3; quick 1)",
    )
    ap.add_argument(
        "--warm-reps",
        type=int,
        default=None,
        help="warm (or floor) runs per prompt, each after reset_prefix_cache() (default 5; quick 3)",
    )
    ap.add_argument("--tput-prompts", type=int, default=None, help="default 16; quick 8")
    ap.add_argument("--tput-tokens", type=int, default=1024)
    ap.add_argument("--tput-max-tokens", type=int, default=32)
    ap.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="throughput rounds, configurations interleaved (default 3; quick 1)",
    )
    ap.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    ap.add_argument(
        "--via",
        choices=("in-tree", "module"),
        default="in-tree",
        help="how vLLM loads lmcache (see vllm_demo.py)",
    )
    ap.add_argument("--model-root", type=pathlib.Path, default=REPO_ROOT / ".demo")
    ap.add_argument("--json", type=pathlib.Path, default=None, help="also write all figures here")
    ap.add_argument(
        "--verbose",
        action="store_true",
        help="keep vLLM's logs, warnings, progress bars and lmcache's INFO lines",
    )
    ap.add_argument("--worker", choices=CONFIGS, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=pathlib.Path, help=argparse.SUPPRESS)
    ap.add_argument("--no-ttft", dest="ttft", action="store_false", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.reps = args.reps or (1 if args.quick else 3)
    args.warm_reps = args.warm_reps or (3 if args.quick else 5)
    args.tput_prompts = args.tput_prompts or (8 if args.quick else 16)
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.sizes = sorted(args.sizes)
    return args


def child_argv(args: argparse.Namespace, cfg: str, out: pathlib.Path, ttft: bool) -> list[str]:
    argv = [
        sys.executable,
        str(pathlib.Path(__file__).resolve()),
        "--worker",
        cfg,
        "--out",
        str(out),
        "--sizes",
        *map(str, args.sizes),
        "--reps",
        str(args.reps),
        "--warm-reps",
        str(args.warm_reps),
        "--tput-prompts",
        str(args.tput_prompts),
        "--tput-tokens",
        str(args.tput_tokens),
        "--tput-max-tokens",
        str(args.tput_max_tokens),
        "--via",
        args.via,
        "--model-root",
        str(args.model_root),
    ]
    if args.tiny:
        argv.append("--tiny")
    if not ttft:
        argv.append("--no-ttft")
    if args.verbose:
        argv.append("--verbose")
    return argv


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_third_party(args.verbose)  # also reaches the child processes through the environment
    if args.worker:
        res = run_config(args)
        args.out.write_text(json.dumps(res))
        return 0

    t_start = time.perf_counter()
    params = SMOKE_MODEL if args.tiny else DEMO_MODEL
    build_model(params, args.model_root)  # once, before the children (they reuse it)
    results: dict[str, dict[str, Any]] = {}
    failed: list[str] = []
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="lmcache-bench-") as tmp:
        for rnd in range(args.rounds):
            for cfg in args.configs:
                if any(f.startswith(f"configuration '{cfg}'") for f in failed):
                    continue
                out = pathlib.Path(tmp) / f"{cfg}-{rnd}.json"
                what = "TTFT + throughput" if rnd == 0 else "throughput"
                log(
                    f"round {rnd + 1}/{args.rounds}, configuration '{cfg}' ({what}): "
                    "starting a vLLM process ..."
                )
                rc = subprocess.call(child_argv(args, cfg, out, ttft=rnd == 0), env=env)
                if rc != 0 or not out.exists():
                    failed.append(f"configuration '{cfg}' failed (exit status {rc})")
                    log(f"configuration '{cfg}' FAILED (exit status {rc}); continuing")
                    continue
                res = json.loads(out.read_text())
                if rnd == 0:
                    results[cfg] = res
                else:
                    results[cfg]["throughput"] += res["throughput"]
    if "none" not in results:
        print("FAILED: the baseline (vLLM without connector) did not run", file=sys.stderr)
        return 1
    problems = report(results, args) + failed
    log(f"benchmark finished in {(time.perf_counter() - t_start) / 60:.1f} min")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    for p in problems:
        print(f"FAILED: {p}", file=sys.stderr, flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
