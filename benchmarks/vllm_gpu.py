# SPDX-License-Identifier: Apache-2.0
"""Real vLLM on a CUDA GPU alone, with lmcache (checksums on, off), with its own CPU offloading.

Cold and warm TTFT, throughput at 0 % reuse, each engine against vLLM alone.

Run on a CUDA machine with vLLM importable (offline: ``tools/gpu_engines/README.md``)::

    python benchmarks/vllm_gpu.py [--quick] [--layers {8,32}] [--tokens 16384] [--reps 5]
        [--rounds 3] [--tput-reps 1] [--engines base,on,off,offload] [--profile DIR]

``--smoke`` runs it all on a 2-layer model and 1k-token prompts (vLLM's CPU build without a
GPU, where the ``offload`` engine is skipped with the reason printed): it checks the script, not
lmcache.

Model: a random Llama with Llama-3-8B attention geometry (hidden 4096, 32 query heads, 8 KV
heads of 128, bf16), 32 layers with MLP 4096 (16k tokens = 2 GiB of KV; 6.4 GB of weights, built
once per machine under the temporary folder) or ``--layers 8`` with MLP 8192. Engines run one
after the other in this process, eager mode, 16-token blocks (``--engines``, default all four):

- ``base``: vLLM alone;
- ``on`` and ``off``: vLLM with lmcache (an empty tier, its host pool holding every prompt and
  pinned before timing), its checksums on and off (lmcache's default for CUDA engines is on),
  so that the cost of verification is read from one run;
- ``offload``: vLLM's own ``OffloadingConnector`` (``cpu_bytes_to_use``: lmcache's pool bytes).

Rounds: ``--rounds N`` (default 3; ``--quick`` and ``--smoke`` 1) starts a fresh engine of each
kind per round, in forward then backward order (base, on, off, offload, offload, off, on, base,
base, ...), so that the machine's drift over a run weighs on every engine alike; every figure is
the median over all rounds' samples, and each round's figures are printed too. Each engine
serves both the TTFT requests and the throughput batches of its round (its start, ~30-40 s for
32 layers on an H200, is what a round costs; its measurements take a few seconds): the default
32-layer run starts 12 engines, about 9 minutes on an H200 by that estimate (not yet timed);
the log gives each engine's start time and the whole run's. Fewer rounds of TTFT than of
throughput would save only those few seconds per engine, so every round measures both.
Per engine:

- ``cold``: TTFT of a prompt never seen (vLLM's own figure, ``RequestOutput.metrics.
  first_token_latency``: what ``vllm:time_to_first_token_seconds`` reports), median over
  ``--reps``; ``generate()``'s wall time (``max_tokens=1``) is printed beside it;
- ``floor``: the same prompts again at once, served by vLLM's own prefix cache (one token
  computed: the decode step of the bound below);
- ``warm``: the same prompts again after ``reset_prefix_cache()`` (vLLM's own cache emptied:
  without a connector that is a recompute, with one a load); the first warm request of each
  engine (its first load) is a row of its own, beside the median of the later ones;
- ``throughput``: prompt tokens per second for a batch of distinct 2k-token prompts (0 % reuse),
  ``--tput-reps`` batches of new prompts per engine and round.

Targets printed next to the figures, per engine: cold within +2 % of vLLM alone, later warm at
most 1.1x the *physical bound* (the prompt's KV bytes over a pinned host-to-device copy, timed
with CUDA events before the engines start, plus vLLM alone's ``floor``, both measured in the
same run), the first warm request at most 1.1x the later ones, throughput at least 99 % of vLLM
alone; and lmcache's warm TTFT with checksums on within 3 % of off.

``--gpu-trace`` adds, per engine, where the GPU's time went during the cold requests and the
throughput batches (``torch.profiler``, CUDA activity only): kernel time on vLLM's stream and on
lmcache's streams, idle time by gap size, between which kernels the short waits (0.1-5 ms) fall,
which host work overlapped the GPU's waits (lmcache's hooks and save jobs split into planning,
copying, the commit gate's wait and publishing; vLLM's own ``schedule``, ``execute_model``,
``sample_tokens``...; Python's garbage collections), how late vLLM's own device-to-host copies
started, and for the third cold request a timeline of the GPU's waits and the host work on one
clock. The timing wrappers slow lmcache's hooks a little, so traced runs are for finding where
time goes, not for the targets. ``--first-prefix-hit`` measures something else
instead: vLLM alone's own prefix-cache hits in a fresh process (the first prefill over cached
context of a process is slow, with or without lmcache). ``--parts CYCLES`` also measures
something else instead: lmcache's throughput cost split into its lookups and its saves, inside
each lmcache engine (switched between batches, compared over pairs from the same engine and
cycle), which leaves out the spread between engines, and Python's garbage collections per
batch (time, full collections) for each part (``--parts 12 --rounds 2``: about 4 minutes on an
H200).
"""

from __future__ import annotations

import argparse
import os
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
from _common import event_ms, log, median
from vllm_gpu_profile import Profile
from vllm_gpu_runs import VARIANTS, cold_variant, first_prefix_hit, parts, run_engine
from vllm_gpu_table import ENGINES, pooled, print_rounds, print_table, round_order


def h2d_ceiling_ms(nbytes: int) -> float:
    """Device ms of one pinned host-to-device copy of ``nbytes`` (median of 10, in 256 MiB
    pieces back to back between two events)."""
    import torch

    piece = min(nbytes, 256 << 20)
    cuda = torch.cuda.is_available()  # --smoke: a CPU copy stands in
    device = torch.device("cuda" if cuda else "cpu")
    host = torch.empty(piece, dtype=torch.uint8, pin_memory=cuda)
    dev = torch.empty(piece, dtype=torch.uint8, device=device)
    host.random_(0, 255)
    inner = max(1, nbytes // piece)
    ms = median(event_ms(device, lambda: dev.copy_(host, non_blocking=True), 10, 3, inner))
    return ms * nbytes / piece  # event_ms gives the ms of one piece


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument(
        "--layers", type=int, choices=(8, 32), default=32, help="the random model's layers"
    )
    parser.add_argument("--reps", type=int, default=None, help="prompts per engine (5; quick 3)")
    parser.add_argument(
        "--batch", type=int, default=None, help="2k-token prompts per batch (32; quick 16)"
    )
    parser.add_argument("--quick", action="store_true", help="3 prompts, batches of 16")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="checks the script: a 2-layer model, 1k-token prompts, 2 prompts, batches of 2 "
        "(vLLM's CPU build when there is no GPU)",
    )
    parser.add_argument(
        "--tput-reps",
        type=int,
        default=1,
        help="throughput batches per engine, each of new prompts; the median is reported",
    )
    parser.add_argument(
        "--engines",
        default=None,
        metavar="LIST",
        help="the engines compared, comma-separated: base (vLLM alone), on / off (lmcache, its "
        "checksums on / off), offload (vLLM's OffloadingConnector); default all four",
    )
    parser.add_argument(
        "--checksum",
        choices=("default", "on", "off"),
        default="default",
        help="lmcache's checksum setting for the lmcache and no-save engines of --cold-variants "
        "and --parts (default: unset, lmcache's default for CUDA engines); on or off without "
        "--engines compares base with that one engine only",
    )
    parser.add_argument(
        "--sync-saves",
        action="store_true",
        help="for comparison: run each save inline in wait_for_save (copy + commit, as before "
        "saves went off the step)",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        metavar="DIR",
        help="time lmcache's hooks per phase, write the main thread's cProfile of each phase "
        "to DIR and print CPU seconds per thread",
    )
    parser.add_argument(
        "--cold-variants",
        default="",
        metavar="LIST",
        help="after the main table, cold TTFT only (--cold-reps requests each) of these engines, "
        "one after the other, comma-separated: base (vLLM alone again: the drift of the "
        "machine), lmcache (--checksum's config), on, off, offload, no-save (kv_role "
        "kv_consumer: lookups only)",
    )
    parser.add_argument("--cold-reps", type=int, default=15)
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="fresh engines per variant, forward then backward (base, on, off, offload, offload, "
        "off, on, base, ...); the figures are medians over every round's samples, and each "
        "round's are printed (default 3; --quick and --smoke 1; --parts 1)",
    )
    parser.add_argument(
        "--cprofile-hooks",
        default="",
        metavar="LIST",
        help="with --profile --no-cprofile: a cProfile of only these hooks (comma-separated "
        "method names, e.g. get_num_new_matched_tokens,bind), all phases, to DIR/hook-NAME.txt "
        "(from Python 3.12 one profile runs at a time: a call overlapping another is skipped)",
    )
    parser.add_argument(
        "--cprofile-jobs",
        action="store_true",
        help="with --profile: a cProfile of the save jobs on their own threads (planning, "
        "copies, commits), all phases, to DIR/job-{plan,copy,commit}.txt (from Python 3.12 a "
        "profile records every thread while it runs: vLLM's thread's calls meanwhile too)",
    )
    parser.add_argument(
        "--no-cprofile",
        action="store_true",
        help="with --profile: only the hook times, save jobs and thread CPU (cProfile sees "
        "every thread and slows lmcache's Python several times over)",
    )
    parser.add_argument(
        "--gpu-trace",
        action="store_true",
        help="per engine, where the GPU's time went during the cold requests and the "
        "throughput batches (torch.profiler, CUDA activity): kernel time per stream, idle time, "
        "copies, host work (lmcache's and vLLM's) while the GPU waited, vLLM's own copies "
        "started late, and one cold request's timeline",
    )
    parser.add_argument(
        "--parts",
        type=int,
        default=0,
        metavar="CYCLES",
        help="instead of the comparison: lmcache's throughput cost split into lookups and "
        "saves inside each lmcache engine (CYCLES cycles of full / lookups-only / saves-only / "
        "off, switched between batches; --rounds ABBA engines, vLLM alone's for reference)",
    )
    parser.add_argument(
        "--first-prefix-hit",
        action="store_true",
        help="instead of the comparison: vLLM alone's own prefix-cache hits in this fresh "
        "process, the first hit of the process first",
    )
    args = parser.parse_args()
    if args.smoke:
        args.tokens, args.layers = min(args.tokens, 1024), 2
    if args.engines is None:  # --checksum on/off alone: that engine against vLLM alone
        args.engines = "base," + args.checksum if args.checksum != "default" else ",".join(ENGINES)
    engines = [e for e in args.engines.split(",") if e]
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown or not engines or len(set(engines)) < len(engines):
        parser.error(
            f"--engines: a comma list of distinct {', '.join(ENGINES)}; got {args.engines!r}"
        )
    for variant in filter(None, args.cold_variants.split(",")):
        if variant not in VARIANTS:
            parser.error(f"--cold-variants: unknown {variant!r}; expected some of {VARIANTS}")
    args.reps = args.reps or (2 if args.smoke else 3 if args.quick else 5)
    args.batch = args.batch or (2 if args.smoke else 16 if args.quick else 32)
    # the smoke: lmcache_vllm.testing's tiny Llama; else Llama-3-8B attention, MLP 8192 at 8
    # layers and 4096 at 32 (6.4 GB of weights, built in well under a minute)
    geometry = (
        {"hidden_size": 256, "num_heads": 4, "num_kv_heads": 2, "head_dim": 64, "vocab_size": 1000}
        if args.smoke
        else {"hidden_size": 4096, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128}
    )
    geometry.setdefault("vocab_size", 32000)
    geometry["intermediate_size"] = 512 if args.smoke else 8192 if args.layers == 8 else 4096
    vocab = geometry["vocab_size"]
    if args.sync_saves:
        from lmcache_vllm.worker.save_queue import SaveQueue

        def _inline(self: SaveQueue, req_id: str, copy: Any, fence: Any = None) -> None:
            commit = copy()
            if callable(commit):
                commit()

        SaveQueue.submit = _inline  # type: ignore[method-assign]

    import torch

    from lmcache_vllm.testing import build_tiny_llama, make_prompt

    if not torch.cuda.is_available() and not args.smoke:
        raise SystemExit("vllm_gpu.py needs a CUDA GPU (--smoke runs on vLLM's CPU build)")
    device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (smoke)"
    import vllm

    name = "smoke" if args.smoke else "llama3-8b-geometry"
    folder = Path(tempfile.gettempdir()) / "lmcache-bench" / f"{name}-l{args.layers}"
    log(f"model: random Llama, {args.layers} layers -> {folder}")
    model = build_tiny_llama(
        folder,
        num_layers=args.layers,
        max_position_embeddings=args.tokens + 1024,
        **geometry,
    )
    prompts = [
        make_prompt(args.tokens, seed=100 + i, vocab_size=vocab) for i in range(args.reps + 1)
    ]
    batches = [
        [
            make_prompt(min(2048, args.tokens), seed=1000 + r * args.batch + i, vocab_size=vocab)
            for i in range(args.batch)
        ]
        for r in range(args.tput_reps)
    ]
    max_len = args.tokens + 64
    kv_heads, head = geometry["num_kv_heads"], geometry["head_dim"]
    print(
        f"{device_name}, vLLM {vllm.__version__}, random Llama: {args.layers} "
        f"layers, {geometry['num_heads']} q / {kv_heads} kv heads of {head}, bf16, prompt {args.tokens} "
        "tokens",
        flush=True,
    )
    # the physical bound's transfer part: the prompt's KV over a pinned host-to-device copy
    kv_bytes = args.tokens * args.layers * 2 * kv_heads * head * 2
    h2d_ms = h2d_ceiling_ms(kv_bytes)
    runs.ENGINE_MEMORY = 0.3 if args.layers > 8 else 0.1  # 32 layers: 6.4 GB of weights

    if args.first_prefix_hit:
        first_prefix_hit(model, max_len, prompts)
        return
    prof = Profile(
        args.profile,
        cprofile=not args.no_cprofile,
        hooks=[h for h in args.cprofile_hooks.split(",") if h],
        jobs=args.cprofile_jobs,
        spans=args.gpu_trace,
    )
    # room for every prompt of an engine (2 GiB each at 32 layers): a warm request must not find
    # its prompt evicted by the cold ones after it
    pool_gib = max(8.0, (args.reps + 1) * kv_bytes / 2**30 + 1)
    extra: dict[str, Any] = {"lmcache.max_local_cpu_size": pool_gib}
    if args.checksum != "default":
        extra["lmcache.checksum"] = args.checksum == "on"
    kv = {
        "kv_connector": "LMCacheConnectorV1",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }
    if args.parts:
        parts(model, kv, max_len, args.rounds or 1, args.parts, args.batch)
        return
    if not torch.cuda.is_available() and "offload" in engines:
        engines.remove("offload")
        print(
            "offload: skipped: vLLM's OffloadingConnector does not run on vLLM's CPU build "
            "(its transfers are CUDA copies)",
            flush=True,
        )
    rounds = args.rounds or (1 if args.smoke or args.quick else 3)
    began = time.perf_counter()
    samples: dict[str, list[dict[str, list[float]]]] = {e: [] for e in engines}
    for rnd in range(rounds):
        # forward, then backward: the machine's drift over a run weighs on every engine alike
        for variant in round_order(engines, rnd):
            tag = variant if rounds == 1 else f"{variant}{rnd + 1}"
            samples[variant].append(
                run_engine(variant, model, kv, max_len, prompts, batches, prof, tag, args.gpu_trace)
            )
    took = time.perf_counter() - began
    if rounds > 1:
        print_rounds(samples)
    prof.report()
    figures = {e: pooled(samples[e]) for e in engines}
    for variant in filter(None, args.cold_variants.split(",")):
        seeds = range(5000 + 100 * len(variant), 5000 + 100 * len(variant) + args.cold_reps + 1)
        cold_prompts = [make_prompt(args.tokens, seed=s, vocab_size=vocab) for s in seeds]
        med = cold_variant(variant, model, kv, max_len, cold_prompts)
        against = (
            f" ({100 * (med / figures['base']['cold'] - 1):+.1f} % against vLLM alone above)"
            if "base" in figures
            else ""
        )
        print(
            f"variant {variant:<12} cold TTFT median of {args.cold_reps}: {1e3 * med:.1f} ms"
            + against,
            flush=True,
        )
    from lmcache.config import LMCacheConfig

    default_on = LMCacheConfig().checksum_for("cuda", True)  # vLLM's CUDA connector sums on the GPU
    print_table(
        figures,
        f"vLLM {vllm.__version__} on {device_name}, random Llama {args.layers} layers "
        f"({kv_heads} KV heads of {head}), {args.tokens}-token prompts, medians over {rounds} "
        f"round{'s' * (rounds > 1)} of {args.reps} prompts and {args.tput_reps} batch"
        f"{'es' * (args.tput_reps > 1)} of {args.batch}",
        h2d_ms,
        kv_bytes,
    )
    print(
        "TTFT: vLLM's RequestOutput.metrics.first_token_latency (vllm:time_to_first_token_seconds)"
    )
    print(
        f"lmcache: host pool {pool_gib:.1f} GiB (offload: the same bytes); checksums by default "
        f"{'on' if default_on else 'off'} for CUDA engines; saves "
        f"{'inline (synchronous)' if args.sync_saves else 'off the step (default)'}"
    )
    order = ", ".join(e for rnd in range(rounds) for e in round_order(engines, rnd))
    print(f"{len(engines) * rounds} engines in {took:.0f} s, in this order: {order}")


if __name__ == "__main__":
    main()
