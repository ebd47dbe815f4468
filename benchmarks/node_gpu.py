# SPDX-License-Identifier: Apache-2.0
"""Two vLLM engine processes on one GPU sharing lmcache's node cache (``node_cache: true``).

The GPU acceptance of the node cache (``docs/node_cache.md``). Engines are separate Python
processes (``node_gpu_engine.py``), one after the other on the GPU, over one node cache owner
this script starts (``python -m lmcache.node serve``, the command engines would autostart) in a
private folder of this run:

1. ``base``: vLLM alone: cold TTFT of new prompts Q, and the floor (the same prompts again,
   vLLM's own prefix-cache hit: only the last block computed).
2. ``A``: the node cache: cold TTFT of prompts P (stored), the floor, ``reset_prefix_cache()``,
   warm TTFT of P (its own chunks). It then stays alive, idle, holding its GPU memory.
3. ``B``: the node cache, started once A stored P, with A still alive: cold TTFT of Q (nobody
   stored them), the floor, warm TTFT of P (chunks A stored, which B's prefix cache never saw),
   warm TTFT of Q (its own chunks). Then A and B exit.
4. ``local``: lmcache's default per-process CPU tier, as A on prompts R: whether the node cache
   is as fast as the default (``--no-local`` leaves it out).

Targets: B's warm TTFT (A's chunks) within 5 % of A's warm TTFT (its own); B's cold TTFT within
+2 % of vLLM alone's; both beside the physical bound (the prompt's KV bytes over a pinned
host-to-device copy measured in this run, plus the floor). Correctness: B's greedy tokens on
A's chunks equal A's cold tokens of the same prompts, and B's hit covers at least the prompt's
full chunks minus one; exits 1 otherwise. ``--smoke`` runs it on vLLM's CPU build (2-layer
model, 1k-token prompts, no copy ceiling).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import build_model, describe_model, log, quiet_third_party  # noqa: E402
from node_gpu_engine import node_folder, owner_stats, start_owner  # noqa: E402

CHUNK = 256
GIB = 1 << 30
ROLES = ("base", "A", "B")


def model_params(layers: int, tokens: int, smoke: bool) -> dict[str, int]:
    """``vllm_gpu.py``'s models: the smoke's tiny Llama, else Llama-3-8B attention with MLP 8192
    at 8 layers and 4096 at 32 (6.4 GB of weights)."""
    if smoke:
        shape = {"hidden_size": 256, "num_heads": 4, "num_kv_heads": 2, "head_dim": 64}
        shape.update(vocab_size=1000, intermediate_size=512)
    else:
        shape = {"hidden_size": 4096, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128}
        shape.update(vocab_size=32000, intermediate_size=8192 if layers == 8 else 4096)
    return dict(shape, num_layers=layers, max_position_embeddings=tokens + 1024, seed=0)


def start_engine(role: str, spec: dict[str, Any], work: Path) -> subprocess.Popen[bytes]:
    out = open(work / f"{role}.log", "w")  # noqa: SIM115 - the child holds it
    try:
        return subprocess.Popen(
            [sys.executable, "-u", str(HERE / "node_gpu_engine.py"), json.dumps(spec)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    finally:
        out.close()


def wait_result(
    role: str, proc: subprocess.Popen[bytes], work: Path, end: float, exit_too: bool
) -> dict[str, Any] | None:
    """``<role>.json`` once written, or ``None`` when the process exited without one or ``end``
    passed (the log's tail printed). With ``exit_too`` the process is then given 90 s to exit
    (its GPU memory must be free for the next engine), and killed after."""
    path = work / f"{role}.json"
    while time.time() < end and not path.exists() and proc.poll() is None:
        time.sleep(0.2)
    if path.exists():
        if exit_too:
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                print(f"{role}: did not exit 90 s after its result: killed", flush=True)
                proc.kill()
                proc.wait(30)
        return dict(json.loads(path.read_text()))
    if proc.poll() is None:
        print(f"{role}: still running at the end of --budget-s: killed", flush=True)
        proc.kill()
    tail = (work / f"{role}.log").read_text()[-4000:]
    print(f"{role}: no result (exit {proc.poll()}); the end of {work / (role + '.log')}:\n{tail}")
    return None


def size(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / (1 << 20):.1f} MiB"


def med(result: dict[str, Any] | None, phase: str) -> float:
    rows = (result or {}).get("phases", {}).get(phase, [])
    return statistics.median(r["ttft_ms"] for r in rows) if rows else float("nan")


def check_tokens(a: dict[str, Any], b: dict[str, Any], least_hit: int) -> tuple[str, str]:
    """B's tokens on A's chunks against A's cold tokens, and B's hit sizes; ``(verdict, what)``.

    The verdict is ``pass``, ``FAIL``, or ``pass*`` where B's tokens differ from A's cold ones
    exactly as A's own lmcache hit and vLLM's own prefix-cache hit (the floor) of the same prompt
    do: bf16 numerics of a prefill over cached KV, which no cache can change.
    """
    a_cold, a_floor, a_warm = (a["phases"].get(k, []) for k in ("cold", "floor", "warm"))
    lines, verdicts = [], [] if b["phases"].get("warm") else ["FAIL"]

    def tokens(rows: list[dict[str, Any]], i: int) -> list[int] | None:
        return rows[i]["tokens"] if i < len(rows) else None

    for i, row in enumerate(b["phases"].get("warm", [])):
        hit_ok = row["cached"] >= least_hit and row["external"] > 0
        if not hit_ok:
            verdict = "FAIL"
        elif row["tokens"] == tokens(a_cold, i):
            verdict = "pass"
        elif row["tokens"] == tokens(a_warm, i) == tokens(a_floor, i):
            verdict = "pass*"
        else:
            verdict = "FAIL"
        verdicts.append(verdict)
        lines.append(
            f"  P{i}: A cold {tokens(a_cold, i)}, A floor {tokens(a_floor, i)}, A hit "
            f"{tokens(a_warm, i)}, B hit {row['tokens']} ({row['cached']} tokens cached, "
            f"{row['external']} from the connector, >= {least_hit} wanted): {verdict}"
        )
    verdict = "FAIL" if "FAIL" in verdicts else "pass*" if "pass*" in verdicts else "pass"
    if verdict == "pass*":
        lines.append(
            "  pass*: B's tokens equal A's own hit and vLLM's own prefix-cache hit, which both "
            "differ from the cold run (bf16 numerics of a prefill over cached KV)"
        )
    return verdict, "\n".join(lines)


def report(
    res: dict[str, dict[str, Any] | None],
    h2d_ms: float | None,
    kv_bytes: int,
    least_hit: int,
    title: str,
) -> int:
    base, a, b = res.get("base"), res.get("A"), res.get("B")
    for role, r in res.items():
        if r:
            extra = f", arena {r['arena']}" if r.get("arena") else ""
            print(f"{role}: started in {r['startup_s']:.1f} s{extra}; lmcache {r['lmcache']}")
            for note in r["notes"]:
                print(f"{role}: {note}")
            for phase, rows in r["phases"].items():
                print(
                    f"{role} {phase}: TTFT (ms) "
                    + " ".join(f"{x['ttft_ms']:.1f}" for x in rows)
                    + "; tokens cached "
                    + " ".join(str(x["cached"]) for x in rows)
                )
    correct, checks = "FAIL", "  (A or B gave no result)"
    if a and b:
        correct, checks = check_tokens(a, b, least_hit)
        same_cold = [
            x["tokens"] == y["tokens"]
            for x, y in zip(
                (base or {}).get("phases", {}).get("cold", []), b["phases"]["cold"], strict=False
            )
        ]
        if same_cold:
            print(f"B cold tokens equal vLLM alone's on Q: {sum(same_cold)}/{len(same_cold)}")
    print("correctness (B's tokens on A's chunks against A's cold tokens):\n" + checks)

    def ms(x: float) -> str:
        return "n/a" if x != x else f"{x:.1f}"

    def times(x: float) -> str:
        return "n/a" if x != x else f"{x:.3f}x"

    def hits(r: dict[str, Any] | None, phase: str) -> str:
        rows = (r or {}).get("phases", {}).get(phase, [])
        return "/".join(str(x["cached"]) for x in rows) or "-"

    floor = med(a, "floor")
    bound = (h2d_ms + floor) if h2d_ms is not None else float("nan")
    warm_ratio = med(b, "warm") / med(a, "warm")
    cold_ratio = med(b, "cold") / med(base, "cold")
    local_warm = med(res.get("local"), "warm")

    def verdict(x: float, limit: float) -> str:
        return "n/a" if x != x else "met" if x <= limit else "missed"

    def pct(x: float) -> str:
        return "n/a" if x != x else f"{100 * (x - 1):+.1f} %"

    print(f"\n{title}\n")
    print("| engine | cold ms | floor ms | warm ms | hit tokens | target | verdict |")
    print("|---|---|---|---|---|---|---|")
    rows = [
        ("vLLM alone (Q)", base, "cold", "-", "", "reference for B's cold", ""),
        (
            "A: node cache, its own chunks (P)",
            a,
            "cold",
            "warm",
            "warm",
            f"reference for B's warm (A's cold {pct(med(a, 'cold') / med(base, 'cold'))} "
            "against alone, other prompts)",
            "",
        ),
        (
            "B: node cache, cold Q; warm P of A's chunks",
            b,
            "cold",
            "warm",
            "warm",
            f"warm <= 1.05x A's warm: {times(warm_ratio)}; cold <= +2 % of alone: {pct(cold_ratio)}",
            f"{verdict(warm_ratio, 1.05)} / {verdict(cold_ratio, 1.02)}",
        ),
        ("B: its own chunks (Q again)", b, "-", "own", "own", "", ""),
        (
            "per-process lmcache (the default), its own chunks (R)",
            res.get("local"),
            "cold",
            "warm",
            "warm",
            f"node cache as fast: A's warm / this warm {times(med(a, 'warm') / local_warm)}",
            "",
        ),
    ]
    for name, r, cold, warm, hit, target, v in rows:
        print(
            f"| {name} | {ms(med(r, cold))} | {ms(med(r, 'floor'))} | {ms(med(r, warm))} | "
            f"{hits(r, hit) if hit else '-'} | {target} | {v} |"
        )
    copy = "n/a (no CUDA)" if h2d_ms is None else f"{h2d_ms:.1f} ms"
    print(
        f"| bound: {size(kv_bytes)} of KV over a pinned H2D copy ({copy}) + A's floor | | "
        f"{ms(floor)} | {ms(bound)} | | A's warm {times(med(a, 'warm') / bound)}, B's warm "
        f"{times(med(b, 'warm') / bound)} the bound | |"
    )
    print(
        f"| correctness: B's tokens on A's chunks = A's cold tokens; hit >= {least_hit} tokens "
        f"| | | | {hits(b, 'warm')} | | {correct} |"
    )
    return 1 if correct == "FAIL" else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--layers", type=int, choices=(8, 32), default=32)
    parser.add_argument("--reps", type=int, default=3, help="prompts per phase")
    parser.add_argument("--max-tokens", type=int, default=4, help="greedy tokens per request")
    parser.add_argument(
        "--budget-s", type=float, default=None, help="bound on the whole run (420; --smoke 1800)"
    )
    parser.add_argument(
        "--memory", type=float, default=None, help="gpu_memory_utilization of each engine"
    )
    parser.add_argument("--smoke", action="store_true", help="vLLM's CPU build, 2 layers, 1k")
    parser.add_argument("--no-local", action="store_true", help="no per-process lmcache engine")
    parser.add_argument("--verbose", action="store_true", help="vLLM's and lmcache's logs")
    parser.add_argument(
        "--keep", action="store_true", help="keep the work folder (logs; kept anyway on failure)"
    )
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # log order in pipes
    args.budget_s = args.budget_s or (1800.0 if args.smoke else 420.0)
    began = time.time()
    end = began + args.budget_s
    if args.smoke:
        args.tokens, args.layers = min(args.tokens, 1024), 2
    quiet_third_party(args.verbose)
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        raise SystemExit("node_gpu.py needs a CUDA GPU (--smoke runs on vLLM's CPU build)")
    params = model_params(args.layers, args.tokens, args.smoke)
    model = build_model(params, Path(tempfile.gettempdir()) / "lmcache-bench")
    per_token = args.layers * 2 * params["num_kv_heads"] * params["head_dim"] * 2  # bf16 K, V
    kv_bytes = args.tokens * per_token
    h2d_ms = None
    if cuda:
        from vllm_gpu import h2d_ceiling_ms

        h2d_ms = h2d_ceiling_ms(kv_bytes)
        torch.cuda.empty_cache()  # the engines get the device (this process keeps its context)
        log(f"pinned H2D copy of {kv_bytes / GIB:.2f} GiB: {h2d_ms:.1f} ms")
    # A stores P, B stores Q, each also a warm-up prompt: the arena holds them twice over
    stored = (2 * args.reps * args.tokens + 2 * 512) * per_token
    need = -(-(2 * stored + GIB) // (1 << 20)) << 20
    least = -(-(stored * 11 // 10 + (256 << 20)) // (1 << 20)) << 20
    folder, budget = node_folder(need, least)
    work = Path(tempfile.mkdtemp(prefix="lmcache-node-gpu-"))
    print(
        f"node cache: {folder}, arena {budget / GIB:.1f} GiB (prompts stored: "
        f"{stored / GIB:.1f} GiB); work folder {work}",
        flush=True,
    )
    subprocess.run(["df", "-h", str(folder)], check=False)
    owner = start_owner(folder, budget, idle_exit_s=args.budget_s + 600)
    procs: list[subprocess.Popen[bytes]] = []
    res: dict[str, dict[str, Any] | None] = {}
    try:
        res = run_engines(args, model, params, folder, budget, work, end, procs)
        print(f"node cache owner: {owner_stats(folder)}", flush=True)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
        owner.send_signal(signal.SIGTERM)
        try:
            owner.wait(30)
        except subprocess.TimeoutExpired:
            owner.kill()
        shutil.rmtree(folder, ignore_errors=True)  # the arena: tens of GiB of shared memory
    device = torch.cuda.get_device_name() if cuda else "CPU (smoke)"
    version = next((r["vllm"] for r in res.values() if r), "?")
    title = (
        f"vLLM {version} on {device}, {describe_model(params)}, {args.tokens}-token prompts, "
        f"medians of {args.reps}; node arena {budget / GIB:.1f} GiB in {folder.parent}; "
        f"run {time.time() - began:.0f} s"
    )
    least_hit = (args.tokens // CHUNK - 1) * CHUNK
    rc = report(res, h2d_ms, kv_bytes, least_hit, title)
    if rc == 0 and all(res.get(role) for role in ROLES) and not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"engine logs and results kept in {work}")
    sys.exit(rc)


def run_engines(
    args: argparse.Namespace,
    model: Path,
    params: dict[str, int],
    folder: Path,
    budget: int,
    work: Path,
    end: float,
    procs: list[subprocess.Popen[bytes]],
) -> dict[str, dict[str, Any] | None]:
    """vLLM alone, then A, then B with A alive (see the module docstring); their results."""
    extra = {
        "lmcache.chunk_size": CHUNK,
        "lmcache.local_cpu": True,
        "lmcache.max_local_cpu_size": budget / GIB,
        "lmcache.node_cache": True,
        "lmcache.node_cache_dir": str(folder),
        "lmcache.node_cache_autostart": False,  # the owner above, whose budget is the arena
    }
    kv = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    kv["kv_connector_extra_config"] = extra  # type: ignore[assignment]
    memory = args.memory or (0.3 if args.layers > 8 else 0.1)
    seeds = {k: [s + i for i in range(args.reps)] for k, s in (("P", 100), ("Q", 200), ("R", 300))}
    common = dict(
        model=str(model),
        max_len=args.tokens + 64,
        memory=memory,
        tokens=args.tokens,
        vocab=params["vocab_size"],
        max_tokens=args.max_tokens,
        work=str(work),
        verbose=args.verbose,
        hard_end=end,
        **seeds,
    )
    res: dict[str, dict[str, Any] | None] = {}
    # each engine's share of what is left: vLLM alone a quarter, A a third of the rest, B half
    # of what then remains, the per-process engine (the same CPU budget) the rest
    per_process = {k: v for k, v in extra.items() if not k.startswith("lmcache.node_cache")}
    local = dict(kv, kv_connector_extra_config=per_process)
    engines = [("base", 1 / 4, None), ("A", 1 / 3, kv), ("B", 1 / 2, kv), ("local", 1.0, local)]
    if args.no_local:
        engines = [
            (r, 1 / 3 if r == "base" else 1 / 2 if r == "A" else 1.0, c) for r, _, c in engines[:3]
        ]
    started: dict[str, subprocess.Popen[bytes]] = {}
    for role, share, config in engines:
        left = end - time.time()
        if left < 60 or (role == "B" and not res.get("A")):
            print(f"{role}: skipped ({left:.0f} s of --budget-s left, A: {bool(res.get('A'))})")
            res[role] = None
            continue
        spec = dict(common, role=role, kv=config, warmup_seed=900 + len(res))
        spec["deadline"] = time.time() + share * left - (15 if role == "B" else 0)
        if role == "B":  # only the prompts A stored
            spec["P"] = seeds["P"][: len(res["A"]["phases"]["cold"])]  # type: ignore[index]
        log(f"{role}: starting (measures for up to {spec['deadline'] - time.time():.0f} s)")
        proc = start_engine(role, spec, work)
        procs.append(proc)
        started[role] = proc
        res[role] = wait_result(role, proc, work, end, exit_too=role != "A")
        if role == "B":
            (work / "B.done").touch()  # A exits before the per-process engine starts
            with contextlib.suppress(subprocess.TimeoutExpired):
                started["A"].wait(max(10.0, min(90.0, end - time.time())))
    (work / "B.done").touch()  # A exits (B skipped)
    for proc in procs:
        try:
            proc.wait(max(10.0, end + 60 - time.time()))
        except subprocess.TimeoutExpired:
            proc.kill()
    return res


if __name__ == "__main__":
    main()
