# SPDX-License-Identifier: Apache-2.0
"""Real SGLang alone, with HiCache's storage backends and with ``--enable-lmcache``: TTFT, backup.

SGLang alone, HiCache's host tier, HiCache with SGLang's ``file`` backend and with lmcache's
backend in three layouts, and ``--enable-lmcache``: cold and warm TTFT, backup time, throughput.

Run on a CUDA machine with SGLang importable (offline bundle: ``tools/gpu_engines/``)::

    python benchmarks/sglang_gpu.py [--layers {8,32}] [--tokens 16384] [--engines LIST]
        [--reps 3] [--budget-s 540] [--trace] [--quick]

and on the CPU with SGLang's CPU engine (``nox -s sglang``'s venv, SGLang 0.5.23)::

    SGLANG_USE_CPU_ENGINE=1 python benchmarks/sglang_gpu.py --device cpu --quick [--trace]

Model: a random Llama with Llama-3-8B attention geometry (8 KV heads of 128, bf16), hidden 4096
and 32 query heads, ``--layers 8`` (MLP 8192, the default) or 32 (MLP 4096); on the CPU hidden
256 with 8 query heads of 128 and MLP 512 (the same KV bytes per token and layer, a prefill
cheap enough for 2 cores), 4 layers and 2048-token prompts unless told. 16-token pages. Built
once per machine under the temporary folder, never downloaded.

Each engine runs in its own process (``sglang_gpu_worker.py``), one after the other; the steps
it measures are in that module's docstring. Engines (``--engines``; the default leaves out
``host`` and ``lmc-pf-nosum``):

- ``base``: SGLang alone;
- ``host``: HiCache's host tier alone (``page_first``, kernel I/O);
- ``file``: HiCache with SGLang's ``file`` backend (in ``/dev/shm`` when it has room: memory,
  like lmcache's CPU tier);
- ``lmc-pf``, ``lmc-pfd``, ``lmc-lf``: HiCache with lmcache's backend in ``page_first`` +
  kernel I/O + zero-copy, ``page_first_direct`` + direct I/O + zero-copy, ``layer_first`` +
  kernel I/O + flat pages; ``lmc-pf-nosum``: ``lmc-pf`` with lmcache's ``checksum: false`` (the
  cost of its host checksums);
- ``enable``: ``--enable-lmcache`` (lmcache's engine in process).

Every HiCache engine uses the same settings, the ones that make a hit fastest and complete:
``hicache_storage_prefetch_policy="wait_complete"`` (a request waits for its whole prefetch
instead of computing what a timeout left), ``write_through`` (every page is backed up once
inserted), ``hicache_ratio`` 2 over a device pool of 1.5 prompts.

The bound of a warm request is the prompt's KV bytes over a pinned host-to-device copy (on the
CPU: a host memcpy, torch ``copy_``) measured before the engines start, plus one decode step:
the same engine's own device-cache hit of the same prompt (engines run minutes apart; the
machine's drift between them would weigh on a bound taken from another engine).

``--budget-s`` (default 540; 1500 on the CPU) bounds the run: an engine whose start would pass
it is skipped (said in the output) and an engine measures fewer prompts when its share runs
out. On an H200 an engine starts in 40-75 s and the first request builds kernels (~70 s, once
per machine); each engine then measures for about 20 s, so the default six engines take about
9 minutes by that estimate (not yet timed).

``--backend-only`` starts no engine: lmcache's HiCache backend alone, called the way HiCache's
controller calls it, over a host pool per layout (``sglang_gpu_backend.py``), in seconds.

Every request's greedy token is compared with its cold request's (a row of the table); the
script exits 1 when one differs. ``--trace`` adds lmcache's inner steps and SGLang's storage
steps to the trace report (the calls into each backend are always traced: that is how the
backup time is measured).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sglang_gpu_table import ENGINES, print_table, print_trace

HERE = Path(__file__).resolve().parent
PAGE = 16
OPTIONAL = ("host", "lmc-pf-nosum")
"""Engines run only when named: every HiCache engine measures the host-tier hit too, and
``lmc-pf-nosum`` prices lmcache's host checksums (``lmc-pf`` with ``checksum: false``)."""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def copy_ceiling_s(nbytes: int, device: str) -> float:
    """Seconds to move ``nbytes``: pinned host-to-device copies on CUDA (events, 256 MiB pieces
    back to back), host-to-host ``copy_`` on the CPU; median of 10 after 3."""
    import torch

    piece = min(nbytes, 256 << 20)
    cuda = device == "cuda"
    src = torch.empty(piece, dtype=torch.uint8, pin_memory=cuda).random_(0, 255)
    dst = torch.empty(piece, dtype=torch.uint8, device=device)
    inner = max(1, nbytes // piece)
    times = []
    for i in range(13):
        if cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            sec = start.elapsed_time(end) / 1e3
        else:
            t = time.perf_counter()
            for _ in range(inner):
                dst.copy_(src)
            sec = time.perf_counter() - t
        if i >= 3:
            times.append(sec / inner)
    del src, dst
    if cuda:
        torch.cuda.empty_cache()
    return statistics.median(times) * nbytes / piece


def engine_kwargs(args: argparse.Namespace, name: str, model: Path, work: Path) -> dict[str, Any]:
    """``sgl.Engine`` keyword arguments of engine ``name`` (:data:`ENGINES`)."""
    pool = math.ceil(1.5 * (args.tokens + 64) / PAGE) * PAGE  # holds 1.5 prompts, not 2
    if args.device == "cpu":
        from lmcache_sglang.testing import sglang_engine_kwargs

        kw = sglang_engine_kwargs(model, max_total_tokens=pool, log_level="warning")
    else:  # the settings the GPU tests run on SGLang 0.5.17 (tests/gpu/test_real_sglang_cuda.py)
        kw = {
            "model_path": str(model),
            "attention_backend": "triton",
            "sampling_backend": "pytorch",
            "disable_cuda_graph": True,
            "mem_fraction_static": 0.5,
            "max_total_tokens": pool,
            "page_size": PAGE,
            "dtype": "bfloat16",
            "random_seed": 0,
            "log_level": "warning",
        }
    what = ENGINES[name][1]
    cpu_gb = max(0.25, math.ceil(4 * args.kv_bytes / 2**30 * 4) / 4)  # 4 prompts of KV
    if "hicache" in what:
        layout, io = what["hicache"]
        kw.update(
            enable_hierarchical_cache=True,
            hicache_ratio=2,
            hicache_write_policy="write_through",
            hicache_mem_layout=layout,
            hicache_io_backend=io,
            hicache_storage_prefetch_policy="wait_complete",
        )
        if what.get("storage") == "file":
            kw["hicache_storage_backend"] = "file"
        elif what.get("storage") == "lmcache":
            extra = {
                "backend_name": "lmcache",
                "module_path": "lmcache_sglang.hicache_backend",
                "class_name": "LMCacheHiCacheStorage",
                "interface_v1": what["interface_v1"],
                "max_local_cpu_size": cpu_gb,
            }
            if "checksum" in what:
                extra["checksum"] = what["checksum"]
            kw["hicache_storage_backend"] = "dynamic"
            kw["hicache_storage_backend_extra_config"] = json.dumps(extra)
    if what.get("enable_lmcache"):
        config = work / "lmcache.yaml"  # LMCache's daemon keys (0.5.17 needs them; ignored)
        config.write_text(f"mp_host: 127.0.0.1\nmp_port: 5556\nmax_local_cpu_size: {cpu_gb}\n")
        kw.update(enable_lmcache=True, lmcache_config_file=str(config))
    kw.update(json.loads(args.engine_args or "{}"))
    return kw


def file_dir(args: argparse.Namespace) -> str:
    """Where SGLang's ``file`` backend writes: ``/dev/shm`` when it holds every page stored."""
    need = args.kv_bytes * (2 * (args.reps + 1) + 2) + args.batch * args.batch_tokens * (
        args.kv_bytes // args.tokens
    )
    with contextlib.suppress(OSError):
        st = os.statvfs("/dev/shm")
        if st.f_bavail * st.f_frsize > 1.5 * need:
            return tempfile.mkdtemp(prefix="lmcache-sgb-file-", dir="/dev/shm")
    return tempfile.mkdtemp(prefix="lmcache-sgb-file-")


def run_engine(
    args: argparse.Namespace, name: str, model: Path, work: Path, budget_left: float
) -> dict[str, Any]:
    """Start engine ``name`` in a worker process and return its result."""
    from lmcache_sglang.testing import make_prompt

    folder = work / name
    folder.mkdir(parents=True, exist_ok=True)
    vocab = args.vocab
    what = ENGINES[name][1]
    env: dict[str, str] = {}
    if what.get("storage") == "file":
        env["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = file_dir(args)
    spec = {
        "engine": name,
        "kwargs": engine_kwargs(args, name, model, folder),
        # rep 0 is the warm-up round (not counted)
        "prompts": [
            make_prompt(args.tokens, 99 + i, vocab_size=vocab) for i in range(args.reps + 1)
        ],
        "fillers": [
            make_prompt(args.tokens, 5000 + i, vocab_size=vocab) for i in range(args.reps + 1)
        ],
        "batches": [
            [
                make_prompt(args.batch_tokens, 10_000 + r * args.batch + i, vocab_size=vocab)
                for i in range(args.batch)
            ]
            for r in range(args.tput_reps + 1)  # batch 0: the untimed warm-up
        ],
        "page_size": PAGE,
        "hicache": "hicache" in what,
        "hicache_storage": "storage" in what,
        "stores": "storage" in what or bool(what.get("enable_lmcache")),
        "trace_dir": str(folder / "trace"),
        "trace": args.trace,
        "device": args.device,
        "backup_timeout_s": 120.0,
        "engine_budget_s": max(30.0, budget_left - 30.0),
        "out": str(folder / "result.json"),
        "env": env,
    }
    spec_path = folder / "spec.json"
    spec_path.write_text(json.dumps(spec))
    log_path = folder / "engine.log"
    # never past the run's budget: the worker writes its result after every step, so a cut
    # engine still reports what it measured
    timeout = min(max(budget_left, 60.0), args.engine_timeout_s)
    t0 = time.monotonic()
    with open(log_path, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, str(HERE / "sglang_gpu_worker.py"), str(spec_path)],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1"),
            cwd=str(folder),  # spawned SGLang processes put this folder first on sys.path
            start_new_session=True,
        )
        try:
            rc: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the scheduler and detokenizer too
            proc.wait()
    try:
        result: dict[str, Any] = json.loads(Path(spec["out"]).read_text())
    except (OSError, ValueError):
        result = {"engine": name, "error": "the worker wrote no result"}
    result["wall_s"] = time.monotonic() - t0
    if rc is None:
        result["error"] = (result.get("error") or "") + f" [timed out after {timeout:.0f} s]"
    elif rc != 0 and not result.get("error"):
        result["error"] = f"the worker exited with {rc}"
    if result.get("error"):
        tail = log_path.read_text(errors="replace")[-2500:]
        log(f"{name}: FAILED: {result['error'][:1500]}\n--- engine log tail ---\n{tail}")
    return result


def main() -> None:
    t_start = time.monotonic()  # the budget covers the model build and the ceiling too
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None)
    parser.add_argument("--layers", type=int, default=None, help="8 or 32 on CUDA (8); CPU 4")
    parser.add_argument("--tokens", type=int, default=None, help="prompt tokens (16384; CPU 2048)")
    parser.add_argument("--reps", type=int, default=None, help="prompts per engine (3; quick 2)")
    parser.add_argument("--batch", type=int, default=None, help="prompts per batch (32; CPU 4)")
    parser.add_argument("--batch-tokens", type=int, default=None, help="2048; CPU 512")
    parser.add_argument("--tput-reps", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="2 prompts per engine, batches of 16")
    parser.add_argument(
        "--engines",
        default=",".join(e for e in ENGINES if e not in OPTIONAL),
        metavar="LIST",
        help=f"comma-separated, of {', '.join(ENGINES)} (default all but {', '.join(OPTIONAL)})",
    )
    parser.add_argument(
        "--budget-s", type=float, default=None, help="the run's time budget (540; CPU 1500)"
    )
    parser.add_argument("--engine-timeout-s", type=float, default=600.0)
    parser.add_argument("--trace", action="store_true", help="lmcache's inner steps too")
    parser.add_argument("--engine-args", default="", help="JSON added to every engine's kwargs")
    parser.add_argument("--work", type=Path, default=None, help="logs and results (a temp dir)")
    parser.add_argument(
        "--backend-only",
        action="store_true",
        help="no engine: lmcache's HiCache backend alone over a host pool per layout, backup "
        "and prefetch GB/s, idle and beside a busy Python thread (sglang_gpu_backend.py)",
    )
    args = parser.parse_args()
    engines = [e for e in args.engines.split(",") if e]
    if not engines or set(engines) - set(ENGINES) or len(set(engines)) < len(engines):
        parser.error(f"--engines: a comma list of distinct {', '.join(ENGINES)}")
    import torch

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    cpu = args.device == "cpu"
    if cpu:
        os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    elif not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA GPU (--device cpu runs SGLang's CPU engine)")
    args.budget_s = args.budget_s or (1500.0 if cpu else 540.0)
    args.layers = args.layers or (4 if cpu else 8)
    args.tokens = args.tokens or (2048 if cpu else 16384)
    args.reps = args.reps or (2 if args.quick else 3)
    args.batch = args.batch or (4 if cpu else 16 if args.quick else 32)
    args.batch_tokens = args.batch_tokens or (512 if cpu else 2048)
    if args.backend_only:
        import sglang_gpu_backend

        sglang_gpu_backend.run(args.tokens, args.layers, max(args.reps, 5))
        return
    geometry: dict[str, int] = (
        {"hidden_size": 256, "num_heads": 8, "intermediate_size": 512}
        if cpu
        else {"hidden_size": 4096, "num_heads": 32}
    )
    if not cpu:
        geometry["intermediate_size"] = 8192 if args.layers <= 8 else 4096
    geometry.update(num_kv_heads=8, head_dim=128, vocab_size=32000)
    args.vocab = geometry["vocab_size"]
    args.kv_bytes = args.tokens * args.layers * 2 * 8 * 128 * 2
    from lmcache_sglang.testing import build_tiny_llama

    root = Path(tempfile.gettempdir()) / "lmcache-bench"
    model = build_tiny_llama(
        root / f"sglang-{'cpu' if cpu else 'l3geom'}-l{args.layers}",
        num_layers=args.layers,
        max_position_embeddings=args.tokens + 1024,
        **geometry,
    )
    work = args.work or Path(tempfile.mkdtemp(prefix="lmcache-sglang-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    import sglang

    device_name = torch.cuda.get_device_name() if not cpu else "CPU"
    copy_s = copy_ceiling_s(args.kv_bytes, args.device)
    title = (
        f"{device_name}, SGLang {sglang.__version__}, random Llama {args.layers} layers (8 KV "
        f"heads of 128, bf16), {args.tokens}-token prompts, page {PAGE}, "
        f"{args.reps} prompts per engine after a warm-up"
    )
    log(f"{title}; logs in {work}")
    results: dict[str, dict[str, Any]] = {}
    spent: list[float] = []
    for name in engines:
        elapsed = time.monotonic() - t_start
        guess = statistics.mean(spent) if spent else (45.0 if cpu else 150.0)
        if elapsed + 0.9 * guess > args.budget_s:
            log(f"{name}: skipped, the budget ({args.budget_s:.0f} s) is spent ({elapsed:.0f} s)")
            continue
        log(f"{name}: starting ({ENGINES[name][0]})")
        res = run_engine(args, name, model, work, args.budget_s - elapsed)
        spent.append(res["wall_s"])
        log(f"{name}: done in {res['wall_s']:.0f} s (engine start {res.get('start_s', '?')} s)")
        if not res.get("error") or res.get("samples", {}).get("cold"):
            results[name] = res
        (work / "results.json").write_text(json.dumps(results))  # kept if the run is cut short
    if not results:
        raise SystemExit("no engine ran")
    info = {
        "title": title,
        "kv_bytes": args.kv_bytes,
        "copy_s": copy_s,
        "bw_what": "host memcpy" if cpu else "pinned h2d",
    }
    print_table(results, info)
    print_trace(results, work, args.trace)
    log(f"run: {time.monotonic() - t_start:.0f} s; results in {work / 'results.json'}")
    differs = {e: r["differs"] for e, r in results.items() if r.get("differs")}
    if differs:
        raise SystemExit(f"greedy tokens differ from their reference: {differs}")


if __name__ == "__main__":
    main()
