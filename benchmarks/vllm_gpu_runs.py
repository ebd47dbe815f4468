# SPDX-License-Identifier: Apache-2.0
"""The engines of ``vllm_gpu.py``: a fresh engine per variant, its TTFT and throughput figures,
and the ``--cold-variants``, ``--first-prefix-hit`` and ``--parts`` runs.

:func:`fresh_engine` starts vLLM alone (``base``), with lmcache (``lmcache``: the given config;
``on``/``off``: its checksums on/off), with lmcache answering lookups only (``no-save``), each
over an empty process tier whose host pool is pinned before it is used, or with vLLM's own
``OffloadingConnector`` over as many host bytes (``offload``); :func:`measure` times cold
requests, vLLM's own prefix-cache hits of the same prompts, warm requests after
``reset_prefix_cache()`` and throughput batches on one engine.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _common import gpu_engine, log, shutdown_engine
from vllm_gpu_profile import Profile, on_gc
from vllm_gpu_trace import traced

ENGINE_MEMORY = 0.1
"""vLLM's ``gpu_memory_utilization`` for each engine (``vllm_gpu.py`` raises it for 32 layers)."""


def ttft(
    llm: Any, prompt: list[int], prof: Profile | None = None, hits: list[float] | None = None
) -> tuple[float, float]:
    """``(vLLM's TTFT, generate() wall time)`` of one ``max_tokens=1`` request; ``hits`` gets
    its prompt tokens not computed (``RequestOutput.num_cached_tokens``: vLLM's own prefix
    cache and the connector's hit together).

    vLLM's TTFT is ``RequestOutput.metrics.first_token_latency``: arrival until the engine
    produced the first token, what ``vllm:time_to_first_token_seconds`` reports. The wall time
    adds this process's detokenization of the output (for a 16k prompt of this model's test
    tokenizer ~25 ms on an H200 host, the same with and without lmcache)."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    (out,) = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
    wall = time.perf_counter() - start
    ttft = float(out.metrics.first_token_latency)
    if hits is not None:
        hits.append(float(getattr(out, "num_cached_tokens", None) or 0))
    if prof is not None:
        prof.request(start, ttft)
        if prof.spans is not None:
            prof.spans.append(("bench", "generate()", start, start + wall))
    return ttft, wall


def throughput(llm: Any, prompts: list[list[int]]) -> float:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return sum(len(p) for p in prompts) / (time.perf_counter() - start)


def measure(
    llm: Any,
    prompts: list[list[int]],
    batches: list[list[list[int]]],
    prof: Profile,
    tag: str,
    trace: bool = False,
) -> dict[str, list[float]]:
    ttft(llm, prompts[-1][:512])  # warm-up (distinct tokens)
    ttft(llm, prompts[-1][:512])  # and the process's first prefix-cache hit (a slow one)

    def cold_run() -> list[tuple[float, float]]:
        return [ttft(llm, p, prof) for p in prompts[:-1]]

    if trace:
        cold, gpu = traced(cold_run, prof, timeline=True)
        print(f"{tag}: GPU during the cold requests: {gpu}", flush=True)
    else:
        cold = prof.run(f"{tag}-cold", cold_run)
    # the same prompts again: vLLM's own prefix-cache hits, one token computed (the bound's step)
    floor = [ttft(llm, p)[0] for p in prompts[:-1]]
    llm.reset_prefix_cache()
    hits: list[float] = []
    warm = prof.run(f"{tag}-warm", lambda: [ttft(llm, p, prof, hits) for p in prompts[:-1]])

    def tput_run() -> list[float]:
        return [throughput(llm, b) for b in batches]

    if trace:
        tputs, gpu = traced(tput_run, prof)
        print(f"{tag}: GPU during the throughput batches: {gpu}", flush=True)
    else:
        tputs = prof.run(f"{tag}-tput", tput_run)
    print(
        f"{tag}: TTFT per request (ms), cold "
        + " ".join(f"{1e3 * t:.1f}" for t, _ in cold)
        + "; warm "
        + " ".join(f"{1e3 * t:.1f}" for t, _ in warm)
        + " (tokens hit "
        + " ".join(f"{h:.0f}" for h in hits)
        + "); throughput per batch (tok/s) "
        + " ".join(f"{x:.0f}" for x in tputs),
        flush=True,
    )
    return {
        "cold": [t for t, _ in cold],
        "floor": floor,
        "warm": [t for t, _ in warm],
        "cold_wall": [w for _, w in cold],
        "warm_wall": [w for _, w in warm],
        "tput": tputs,
        "warm_hit": hits,
    }


VARIANTS = ("base", "lmcache", "on", "off", "no-save", "offload")


def engine_config(variant: str, kv: dict[str, Any]) -> dict[str, Any] | None:
    """``variant``'s ``kv_transfer_config`` from lmcache's ``kv`` (see :func:`fresh_engine`)."""
    if variant not in VARIANTS:
        raise SystemExit(f"unknown engine variant {variant!r}; expected one of {VARIANTS}")
    if variant == "base":
        return None
    extra = dict(kv["kv_connector_extra_config"])
    if variant == "offload":
        # the same host bytes as lmcache's pool (max_local_cpu_size is in GiB)
        gib = float(extra.get("lmcache.max_local_cpu_size", 5.0))
        return {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": int(gib * 2**30)},
        }
    if variant in ("on", "off"):
        extra["lmcache.checksum"] = variant == "on"
    config = dict(kv, kv_connector_extra_config=extra)
    if variant == "no-save":
        config["kv_role"] = "kv_consumer"
    return config


@contextlib.contextmanager
def fresh_engine(variant: str, model: Path, kv: dict[str, Any], max_len: int) -> Iterator[Any]:
    """A fresh engine of ``variant`` over an empty process tier, shut down after.

    ``base``: vLLM alone; ``lmcache``: with lmcache's ``kv``; ``on``/``off``: ``kv`` with
    lmcache's checksums on/off; ``no-save``: ``kv`` as ``kv_consumer``, lookups only;
    ``offload``: vLLM's own ``OffloadingConnector`` over as many host bytes as ``kv``'s pool.
    lmcache's host pool is pinned before the engine is used (pinning is not what this
    measures); the seconds until then are logged."""
    from lmcache.tiers import reset_process_cpu_tiers
    from lmcache_vllm.vllm_v1_adapter import live_engines

    config = engine_config(variant, kv)
    reset_process_cpu_tiers()
    start = time.perf_counter()
    llm = gpu_engine(model, config, max_len, ENGINE_MEMORY)
    try:
        for engine in live_engines():
            engine.pool.wait_prepinned(timeout=300)
        log(f"{variant}: engine started in {time.perf_counter() - start:.1f} s")
        yield llm
    finally:
        shutdown_engine(llm)


def run_engine(
    variant: str,
    model: Path,
    kv: dict[str, Any],
    max_len: int,
    prompts: list[list[int]],
    batches: list[list[list[int]]],
    prof: Profile,
    tag: str,
    trace: bool = False,
) -> dict[str, list[float]]:
    """:func:`measure` on a :func:`fresh_engine` of ``variant``; lmcache's counters printed."""
    from lmcache_vllm.vllm_v1_adapter import live_engines

    with fresh_engine(variant, model, kv, max_len) as llm:
        out = measure(llm, prompts, batches, prof, tag, trace)
        names = (
            "stored_chunks",
            "hit_tokens",
            "loaded_chunks",
            "evicted_chunks",
            "failed_allocations",
            "checksum_failures",
            "tier_errors",
        )
        for engine in live_engines():
            m = engine.metrics
            print(f"{tag}:", ", ".join(f"{n}={m.value(n):.0f}" for n in names))
    return out


def cold_variant(
    variant: str, model: Path, kv: dict[str, Any], max_len: int, prompts: list[list[int]]
) -> float:
    """Median cold TTFT of ``prompts[:-1]`` on a :func:`fresh_engine` of ``variant``."""
    with fresh_engine(variant, model, kv, max_len) as llm:
        ttft(llm, prompts[-1][:512])
        cold = [ttft(llm, p)[0] for p in prompts[:-1]]
    print(f"{variant}: cold TTFT per request (ms) " + " ".join(f"{1e3 * t:.1f}" for t in cold))
    return statistics.median(cold)


def first_prefix_hit(model: Path, max_len: int, prompts: list[list[int]]) -> None:
    """vLLM alone, a fresh process: cold prompts, then the same prompts again without a reset
    (vLLM's own prefix-cache hits), every TTFT printed."""
    with fresh_engine("base", model, {}, max_len) as llm:
        ttft(llm, prompts[-1][:512])
        cold = [ttft(llm, p)[0] for p in prompts[:-1]]
        hits = [ttft(llm, p)[0] for p in prompts[:-1]]
    print("vLLM alone, cold TTFT (ms): " + " ".join(f"{1e3 * t:.1f}" for t in cold))
    print(
        "vLLM alone, its own prefix-cache hits, the first of this process first (ms): "
        + " ".join(f"{1e3 * t:.1f}" for t in hits)
    )


_PARTS = {  # variant: (saves planned, lookups asked)
    "full": (True, True),
    "lookups-only": (False, True),
    "saves-only": (True, False),
    "off": (False, False),
}


def parts(
    model: Path, kv: dict[str, Any], max_len: int, rounds: int, cycles: int, batch: int
) -> None:
    """``--parts``: lmcache's throughput cost split into its lookups and its saves, measured
    inside each lmcache engine, so that the spread between engines (as large as the effect)
    drops out. Each lmcache engine runs ``cycles`` cycles of the :data:`_PARTS` variants in
    turn (switched between batches: the scheduler side plans no saves and/or answers every
    lookup with 0 at once), two batches of new prompts per variant, only the second counted
    (the first takes the previous variant's tail); vLLM alone engines run the same batches in
    ABBA order. Prints per engine the median tok/s per variant and the time vLLM's thread spent
    in lmcache's hooks per batch, then every variant against ``off`` over pairs taken in the
    same cycle of the same engine."""
    from lmcache_vllm.scheduler.side import SchedulerSide
    from lmcache_vllm.testing import make_prompt

    switch = {"saves": True, "lookups": True}
    save_spec, matched = SchedulerSide._save_spec, SchedulerSide._matched

    def _save_spec(self: Any, tracker: Any, end: int) -> Any:
        return save_spec(self, tracker, end) if switch["saves"] else None

    def _matched(self: Any, request: Any, rid: str, n: int) -> int | None:
        return matched(self, request, rid, n) if switch["lookups"] else 0

    SchedulerSide._save_spec = _save_spec  # type: ignore[method-assign]
    SchedulerSide._matched = _matched  # type: ignore[method-assign]
    # the hook timing of --profile --no-cprofile, one phase per counted batch
    prof = Profile(Path(tempfile.mkdtemp(prefix="lmcache-parts-")), cprofile=False)
    seed = itertools.count(50_000, batch)
    # Python's garbage collections per phase (any thread; they stop every thread): seconds,
    # full (generation 2) collections
    collected: dict[str, list[float]] = {}

    def _gc(generation: int, start: float, end: float) -> None:
        rec = collected.setdefault(prof.phase, [0.0, 0.0])
        rec[0] += end - start
        rec[1] += generation == 2

    untimed = on_gc(_gc)

    def _batch() -> list[list[int]]:
        first = next(seed)
        return [make_prompt(2048, seed=first + i, vocab_size=32000) for i in range(batch)]

    # (engine, variant) -> [(tok/s, {hook: s})], in cycle order
    got: dict[tuple[str, str], list[tuple[float, dict[str, float]]]] = {}
    for rnd in range(rounds):
        for kind in ("base", "lmcache") if rnd % 2 == 0 else ("lmcache", "base"):
            tag = f"{kind}{rnd + 1}"
            with fresh_engine(kind, model, kv, max_len) as llm:
                for _ in range(2):
                    throughput(llm, _batch())  # warm-up
                order = list(_PARTS)
                for cycle in range(cycles):
                    order = order[1:] + order[:1] if cycle % 2 else order[::-1]
                    for name in order:
                        switch["saves"], switch["lookups"] = _PARTS[name]
                        prof.phase = "skip"
                        throughput(llm, _batch())  # takes the last variant's tail
                        key = (tag, name if kind == "lmcache" else "alone")
                        prof.phase = f"{key}{cycle}"
                        tput = throughput(llm, _batch())
                        calls = {  # vLLM's hooks, not the methods they call
                            short: sec
                            for (ph, hook), (sec, _) in prof.hooks.items()
                            if ph == prof.phase
                            and not (short := hook.rsplit(".", 1)[-1]).startswith("_")
                        }
                        calls[""] = prof.outer.get(prof.phase, 0.0)
                        calls["\0gc"], calls["\0gc2"] = collected.get(prof.phase, (0.0, 0.0))
                        got.setdefault(key, []).append((tput, calls))
                switch["saves"] = switch["lookups"] = True
    gc.callbacks.remove(untimed)
    print(
        f"\n--parts: {cycles} cycles per engine, batches of {batch} new 2k-token prompts "
        "(median tok/s; vLLM's thread in lmcache's hooks, ms per batch, largest first; Python's "
        "garbage collections per batch, time and full ones)"
    )
    for (tag, name), rows in got.items():
        spent: dict[str, float] = {}
        for _, h in rows:
            for hook, sec in h.items():
                spent[hook] = spent.get(hook, 0.0) + sec / len(rows)
        total = spent.pop("", 0.0)
        gc_s, gc_full = spent.pop("\0gc", 0.0), spent.pop("\0gc2", 0.0)
        top = ", ".join(
            f"{hook} {1e3 * sec:.1f}"
            for hook, sec in sorted(spent.items(), key=lambda x: -x[1])[:3]
            if sec >= 5e-5
        )
        med = statistics.median(t for t, _ in rows)
        print(
            f"  {tag:<10} {name:<13} {med:>9.0f} tok/s  hooks {1e3 * total:5.1f} ms"
            + (f" ({top})" if top else "")
            + f"; gc {1e3 * gc_s:.1f} ms, {gc_full:.2f} full"
        )
    alone = [t for (tag, name), rows in got.items() if name == "alone" for t, _ in rows]
    offs = [t for (tag, name), rows in got.items() if name == "off" for t, _ in rows]
    for name in ("full", "lookups-only", "saves-only"):
        pairs = [
            a / b * 100
            for (tag, var), rows in got.items()
            if var == name
            for (a, _), (b, _) in zip(rows, got[(tag, "off")], strict=True)
        ]
        print(
            f"  {name:<13} against off, same engine and cycle: median {statistics.median(pairs):.1f} %, "
            f"mean {statistics.mean(pairs):.1f} % ({len(pairs)} pairs)"
        )
    print(
        f"  off against vLLM alone (other engines: the spread between engines included): "
        f"{statistics.median(offs) / statistics.median(alone) * 100:.1f} % "
        f"({len(offs)} / {len(alone)} batches)"
    )
