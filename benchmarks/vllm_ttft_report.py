# SPDX-License-Identifier: Apache-2.0
"""The tables of ``vllm_ttft.py``: TTFT per prompt size, throughput at 0 % reuse, the targets.

:func:`report` prints them from the configurations' results (what each child process wrote) and
returns the problems that make the run a failure (a wrong first token after a load, a connector
that loaded nothing).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from typing import Any

from _common import DEMO_MODEL, SMOKE_MODEL

CONFIGS = ("none", "lmcache", "example")
TARGET_CACHED_FRACTION = 1 / 5  # cached TTFT <= 1/5 of recompute at 4k
TARGET_LOAD_SPEEDUP = 3.0  # lmcache load >= 3x faster than ExampleConnector
TARGET_TPUT_LOSS = 0.02  # < 2 % throughput loss at 0 % reuse


def memcpy_ceiling(nbytes: int) -> float:
    """Single-thread host memcpy bandwidth (bytes/s) for ``nbytes``: the ceiling of a CPU-tier load.

    numpy, not torch: on 2 busy cores a 2-thread torch copy waits ~8 ms for its second thread.
    """
    import numpy as np

    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    times = []
    for _ in range(9):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return nbytes / min(times[2:])


def med(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def best(xs: Sequence[float | None]) -> float:
    vals = [x for x in xs if x is not None]
    return min(vals) if vals else float("nan")


def ms(x: float) -> str:
    return f"{x * 1e3:.1f}" if x == x else "n/a"


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def report(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> list[str]:
    """Print the tables; return the list of problems that make the run a failure."""
    params = SMOKE_MODEL if args.tiny else DEMO_MODEL
    kv_bytes_per_token = params["num_layers"] * 2 * params["num_kv_heads"] * params["head_dim"] * 2
    problems: list[str] = []
    none = results.get("none")
    sizes = [str(n) for n in args.sizes]

    def col(cfg: str, n: str, key: str) -> float:
        r = results.get(cfg)
        return best([row[key] for row in r["ttft"][n]]) if r and n in r["ttft"] else float("nan")

    w = 112
    print()
    print("=" * w)
    print(
        f"vLLM CPU, random Llama {params['num_layers']} layers / hidden {params['hidden_size']} / "
        f"{params['num_kv_heads']} KV heads x {params['head_dim']} bf16 ({kv_bytes_per_token} B of KV "
        f"per token); TTFT of a max_tokens=1 request in ms; recompute and TTFT: best of "
        f"{args.reps} prompts;\nfloor, warm and load: best of {args.reps} prompts x {args.warm_reps} "
        f"runs"
    )
    print("-" * w)
    head = f"{'TTFT':>9} {'save':>7} {'warm':>7} {'load':>7} {'hit':>5}"
    print(f"{'':6} | {'vLLM alone':^17} | {'lmcache':^39} | {'ExampleConnector':^39} |")
    print(f"{'tokens':>6} | {'recompute':>9} {'floor':>7} | {head} | {head} | {'warm/recomp':>11}")
    summary: dict[str, dict[str, float]] = {}
    direct = True
    for n in sizes:
        rec, floor = col("none", n, "first_ttft"), col("none", n, "again_ttft")
        row = {"recompute": rec, "floor": floor}
        cells = []
        for cfg, tag in (("lmcache", "lmc"), ("example", "ex")):
            store, warm = col(cfg, n, "first_ttft"), col(cfg, n, "again_ttft")
            save, load = col(cfg, n, "first_save_s"), col(cfg, n, "again_load_s")
            hit = col(cfg, n, "again_external")
            if load != load and warm == warm:  # not timed directly (multiprocess mode)
                load, direct = warm - floor, False
            row.update({f"{tag}_store": store, f"{tag}_warm": warm, f"{tag}_load": load})
            hit_s = f"{hit:5.0f}" if hit == hit else "  n/a"
            cells.append(f"{ms(store):>9} {ms(save):>7} {ms(warm):>7} {ms(load):>7} {hit_s}")
        summary[n] = row
        ratio = row["lmc_warm"] / rec
        print(
            f"{n:>6} | {ms(rec):>9} {ms(floor):>7} | {cells[0]} | {cells[1]} | "
            f"{('1/' + format(1 / ratio, '.1f')) if ratio == ratio else 'n/a':>11}"
        )
    print("-" * w)
    load_def = (
        "time inside the connector's start_load_kv + wait_for_layer_load"
        if direct
        else "warm - floor"
    )
    print(
        "recompute: vLLM alone, a new prompt (the ceiling for a cached TTFT). floor: the same prompt "
        "again, served\nby vLLM's own prefix cache (nothing left to prefill). TTFT (connector): first "
        "run, recompute + store. save:\ntime inside the connector's save_kv_layer + wait_for_save in "
        "that run. warm: TTFT after reset_prefix_cache(),\nthe KV loaded by the connector. load: "
        f"{load_def}. hit: tokens the\nconnector supplied (vllm:external_prefix_cache_hits)."
    )

    # correctness: the first generated token must match vLLM alone on every prompt and run
    for cfg in ("lmcache", "example"):
        r = results.get(cfg)
        if not r or not none or not r["ttft"]:
            continue
        for n in sizes:
            for rep, (row_, ref) in enumerate(zip(r["ttft"][n], none["ttft"][n], strict=True)):
                if (
                    row_["again_token"] != ref["first_token"]
                    or row_["first_token"] != ref["first_token"]
                ):
                    msg = (
                        f"{cfg} {n} tokens rep {rep}: token {row_['again_token']} after load, "
                        f"{row_['first_token']} when storing, vLLM alone {ref['first_token']}"
                    )
                    if cfg == "lmcache":
                        problems.append(msg)
                    else:
                        print(f"note: {msg}")
                if not row_.get("again_tokens_same", True):
                    problems.append(f"{cfg} {n} tokens rep {rep}: warm runs disagree")
                if row_["again_external"] <= 0:
                    problems.append(f"{cfg} {n} tokens rep {rep}: nothing loaded by the connector")

    # throughput: one batch per configuration per round, rounds interleaved in time; the loss is the
    # median over rounds of the loss against the baseline run of the same round. Two bases: wall
    # clock (what a user sees; moved by other load) and CPU time of the engine process (the work
    # done; barely moved by other load).
    print()
    print(
        f"throughput, 0 % reuse: {args.tput_prompts} distinct prompts x {args.tput_tokens} tokens, "
        f"{args.tput_max_tokens} generated each, one batch; {args.rounds} round(s), configurations "
        f"interleaved.\n(prompt + generated) tokens per wall second and per CPU second of the engine "
        f"process; loss = median over rounds of\n1 - x / (vLLM alone, same round)"
    )
    losses: dict[str, dict[str, float]] = {}
    noise: dict[str, float] = {}
    base: dict[str, float] = {}
    for key in ("tok_per_s", "tok_per_cpu_s"):
        runs0 = [t[key] for t in none["throughput"]] if none else []
        base[key] = med(runs0)
        noise[key] = (max(runs0) / min(runs0) - 1) if len(runs0) > 1 else float("nan")
        for cfg in CONFIGS:
            r = results.get(cfg)
            if r and r["throughput"]:
                runs = [t[key] for t in r["throughput"]]
                paired = [1 - x / b for x, b in zip(runs, runs0, strict=False)]
                losses.setdefault(cfg, {})[key] = med(paired)
    for cfg in CONFIGS:
        r = results.get(cfg)
        if not r or not r["throughput"]:
            continue
        wall = [t["tok_per_s"] for t in r["throughput"]]
        cpu = [t["tok_per_cpu_s"] for t in r["throughput"]]
        print(
            f"  {cfg:8} wall {med(wall):7.1f} tok/s (runs {' '.join(f'{x:.0f}' for x in wall)}) "
            f"loss {losses[cfg]['tok_per_s'] * 100:+6.2f} %   |   CPU {med(cpu):7.1f} tok/CPU-s "
            f"(runs {' '.join(f'{x:.0f}' for x in cpu)}) loss {losses[cfg]['tok_per_cpu_s'] * 100:+6.2f} %"
        )
    if noise["tok_per_s"] == noise["tok_per_s"]:
        print(
            f"  run-to-run spread of vLLM alone: wall {noise['tok_per_s'] * 100:.1f} %, CPU "
            f"{noise['tok_per_cpu_s'] * 100:.1f} % (other load on this machine)"
        )

    # targets
    big = sizes[-1]
    s = summary[big]
    kv = int(big) * kv_bytes_per_token
    bw = memcpy_ceiling(kv)
    print()
    print("targets")
    ratio = s["lmc_warm"] / s["recompute"]
    print(
        f"  cached TTFT <= 1/5 of recompute at {big} tokens: lmcache warm {ms(s['lmc_warm'])} ms vs "
        f"recompute {ms(s['recompute'])} ms (the ceiling) = 1/{1 / ratio:.1f}   "
        f"[{verdict(ratio <= TARGET_CACHED_FRACTION)}]\n"
        f"      best possible: floor {ms(s['floor'])} ms = 1/{s['recompute'] / s['floor']:.1f}"
    )
    load_x = s["ex_load"] / s["lmc_load"] if s["lmc_load"] > 0 else float("nan")
    warm_x = s["ex_warm"] / s["lmc_warm"]
    print(
        f"  lmcache loads >= 3x faster than ExampleConnector at {big} tokens: load {ms(s['lmc_load'])}"
        f" vs {ms(s['ex_load'])} ms = {load_x:.2f}x   [{verdict(load_x >= TARGET_LOAD_SPEEDUP)}]\n"
        f"      (load = {load_def}; warm TTFT {ms(s['lmc_warm'])} vs {ms(s['ex_warm'])} ms = "
        f"{warm_x:.2f}x)\n"
        f"      ceiling: {kv / 2**20:.0f} MiB of KV; single-thread memcpy here {bw / 1e9:.1f} GB/s -> "
        f"{kv / bw * 1e3:.1f} ms; lmcache loaded at {kv / s['lmc_load'] / 1e9:.2f} GB/s, "
        f"ExampleConnector at {kv / s['ex_load'] / 1e9:.2f} GB/s"
    )
    if "lmcache" in losses:
        for key, what in (("tok_per_s", "wall clock"), ("tok_per_cpu_s", "CPU time")):
            loss, spread = losses["lmcache"][key], noise[key]
            caveat = (
                f"; vLLM alone varied {spread * 100:.1f} % between rounds"
                if spread == spread and abs(loss) < spread
                else ""
            )
            unit = "tok/s" if key == "tok_per_s" else "tok/CPU-s"
            print(
                f"  < 2 % throughput loss at 0 % reuse ({what}): lmcache {loss * 100:+.2f} %   "
                f"[{verdict(loss < TARGET_TPUT_LOSS)}]   (ceiling: vLLM alone {base[key]:.1f} "
                f"{unit}{caveat})"
            )
    print("=" * w, flush=True)
    return problems
