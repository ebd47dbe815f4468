# SPDX-License-Identifier: Apache-2.0
"""Real vLLM on a CUDA GPU with and without lmcache: cold and warm TTFT, throughput at 0 % reuse.

Run on a CUDA machine with vLLM importable (offline: ``tools/gpu_engines/README.md``)::

    python benchmarks/vllm_gpu.py [--tokens 16384] [--reps 5] [--rounds 3] [--tput-reps 5]
        [--checksum {default,on,off}] [--profile DIR [--no-cprofile]]

Model: a random 8-layer Llama with Llama-3-8B attention geometry (hidden 4096, 32 query heads,
8 KV heads of 128, bf16; 16k tokens = 512 MiB of KV), built locally. Engines run one after the
other in this process, eager mode, 16-token blocks: no lmcache, then lmcache with the given
config (an empty tier, its host pool pinned before timing); with ``--rounds N``, N fresh engines
of each in ABBA order (base, lmcache, lmcache, base, ...), every figure the median over all
rounds' samples, so that the machine's drift during a run weighs on both alike (each round's
ratios are printed too). Per engine:

- ``cold``: TTFT of a prompt never seen (vLLM's own figure, ``RequestOutput.metrics.
  first_token_latency``: what ``vllm:time_to_first_token_seconds`` reports), median over
  ``--reps``; ``generate()``'s wall time (``max_tokens=1``) is printed beside it;
- ``warm``: the same prompts again after ``reset_prefix_cache()`` (vLLM's own cache emptied:
  without lmcache that is a recompute, with lmcache a load);
- ``throughput``: prompt tokens per second for a batch of distinct 2k-token prompts (0 % reuse),
  median over ``--tput-reps`` batches of new prompts.

Targets printed next to the figures: cold within +2 %, throughput at least 99 % of no-lmcache,
warm at least 3x faster than recompute.

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
import contextlib
import gc
import itertools
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
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
        gpu_memory_utilization=0.1,  # engines in turn: an engine shut down may not free at once
        dtype="bfloat16",
        max_model_len=max_len,
        max_num_batched_tokens=max_len,
        seed=0,
        kv_transfer_config=kv,
        disable_log_stats=False,  # RequestOutput.metrics: vLLM's own TTFT per request
    )


def _shutdown(llm: Any) -> None:
    from lmcache_vllm.testing import shutdown_llm

    shutdown_llm(llm)


def _ttft(llm: Any, prompt: list[int], prof: _Profile | None = None) -> tuple[float, float]:
    """``(vLLM's TTFT, generate() wall time)`` of one ``max_tokens=1`` request.

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
    if prof is not None:
        prof.request(start, ttft)
        if prof.spans is not None:
            prof.spans.append(("bench", "generate()", start, start + wall))
    return ttft, wall


def _throughput(llm: Any, prompts: list[list[int]]) -> float:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return sum(len(p) for p in prompts) / (time.perf_counter() - start)


def _on_gc(record: Callable[[int, float, float], None]) -> Callable[[str, dict[str, Any]], None]:
    """Call ``record(generation, start, end)`` (``perf_counter`` seconds) after each of Python's
    garbage collections, in whichever thread ran it; returns the callback installed in
    ``gc.callbacks`` (remove it to stop)."""
    began = [0.0]

    def _callback(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            record(int(info.get("generation", -1)), began[0], time.perf_counter())

    gc.callbacks.append(_callback)
    return _callback


class _Profile:
    """``--profile``: time spent in each lmcache hook per phase, the main thread's cProfile of
    each phase, CPU seconds per thread (who competes with vLLM's thread for the GIL), and per
    request the save jobs (copy / commit threads) that ran inside its TTFT window."""

    def __init__(
        self,
        out: Path | None,
        cprofile: bool = True,
        hooks: Sequence[str] = (),
        jobs: bool = False,
        spans: bool = False,
    ) -> None:
        import cProfile

        self.out = out
        # --gpu-trace: (thread, what, start, end) of every hook call on vLLM's thread and
        # every save job, in time.perf_counter() seconds, while ``spans`` is not None
        self.spans: list[tuple[str, str, float, float]] | None = [] if spans else None
        self.cprofile = cprofile
        # --cprofile-hooks / --cprofile-jobs: one cProfile per named hook (main thread) and per
        # save-job kind (its own thread), each enabled only inside its calls
        self.hook_profiles = {name: cProfile.Profile() for name in hooks}
        self.job_profiles = (
            {kind: cProfile.Profile() for kind in ("plan", "copy", "commit")} if jobs else {}
        )
        self._in_hook = False
        self.skipped_profiles = 0  # calls not profiled: another profile was active
        self.phase = ""
        self.hooks: dict[tuple[str, str], list[float]] = {}
        # phase -> seconds vLLM's thread spent in lmcache's hooks, a call inside another once
        # (vLLM 0.26's in-tree wrapper binds inside start_load_kv)
        self.outer: dict[str, float] = {}
        self._depth = 0
        self.rows: list[str] = []
        self.jobs: list[tuple[str, float, float, float]] = []  # kind, start, end, CPU s
        self.requests: list[tuple[str, float, float]] = []  # phase, start, TTFT
        if out is None and not spans:
            return
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
        from lmcache_vllm.save_queue import SaveQueue
        from lmcache_vllm.scheduler import SchedulerSide
        from lmcache_vllm.worker import WorkerSide

        copy, commit = SaveQueue._run_copy, SaveQueue._run_commit

        def _run_copy(queue: Any, req_id: str, job: Any) -> None:
            inner = job.args[0] if getattr(job, "args", None) else job  # SaveQueue._fenced's
            inner = getattr(inner, "func", inner)
            kind = {"_plan_job": "plan", "_drop_job": "drop"}.get(inner.__name__, "copy")
            self._job(kind, lambda: copy(queue, req_id, job))

        def _run_commit(req_id: str, job: Any) -> None:
            self._job("commit", lambda: commit(req_id, job))

        SaveQueue._run_copy = _run_copy  # type: ignore[method-assign]
        SaveQueue._run_commit = staticmethod(_run_commit)  # type: ignore[method-assign]

        for cls in (SchedulerSide, WorkerSide):
            for name, fn in list(vars(cls).items()):
                if name.startswith("__") or not callable(fn):
                    continue
                setattr(cls, name, self._wrap(f"{cls.__name__}.{name}", fn))
        if spans:
            import importlib

            from lmcache.layerwise import StagedStore
            from lmcache_vllm.save_queue import QuietGate

            # the parts of a commit job: asleep (copy, gate) or publishing
            StagedStore.commit = self._span("publish", StagedStore.commit)  # type: ignore[method-assign]
            QuietGate.wait = self._span("gate wait", QuietGate.wait)  # type: ignore[method-assign]

            def _gc(generation: int, start: float, end: float) -> None:  # Python's collections
                if self.spans is not None:
                    self.spans.append(("gc", f"gc gen{generation}", start, end))

            _on_gc(_gc)
            # vLLM's own phases, where this version has them (the timeline places them)
            for module, cls_name, names in (
                (
                    "vllm.v1.worker.gpu.model_runner",
                    "GPUModelRunner",
                    ("execute_model", "prepare_inputs", "prepare_attn", "sample_tokens"),
                ),
                ("vllm.v1.core.sched.scheduler", "Scheduler", ("schedule", "update_from_output")),
            ):
                try:
                    owner = getattr(importlib.import_module(module), cls_name)
                except (ImportError, AttributeError):
                    continue
                for name in names:
                    if callable(getattr(owner, name, None)):
                        setattr(owner, name, self._span(f"vLLM {name}", getattr(owner, name)))

    def _span(self, what: str, fn: Any) -> Any:
        """``fn`` recording a ``(thread name, what, start, end)`` span on any thread."""
        import functools
        import threading

        @functools.wraps(fn)
        def spanned(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                if self.spans is not None:
                    name = threading.current_thread().name
                    self.spans.append((name, what, t, time.perf_counter()))

        return spanned

    def _wrap(self, name: str, fn: Any) -> Any:
        import functools
        import threading

        main = threading.main_thread()

        short = name.rsplit(".", 1)[-1]
        hook_prof = self.hook_profiles.get(short)

        @functools.wraps(fn)
        def timed(*a: Any, **k: Any) -> Any:
            if threading.current_thread() is not main:
                return fn(*a, **k)
            t = time.perf_counter()
            # not when already inside a profiled hook (a profile is enabled only once)
            outer = hook_prof is not None and not self.cprofile and not self._in_hook
            if outer:
                outer = self._enable(hook_prof)
                self._in_hook = outer
            self._depth += 1
            try:
                return fn(*a, **k)
            finally:
                self._depth -= 1
                if outer:
                    hook_prof.disable()  # type: ignore[union-attr]
                    self._in_hook = False
                end = time.perf_counter()
                cell = self.hooks.setdefault((self.phase, name), [0.0, 0])
                cell[0] += end - t
                cell[1] += 1
                if self._depth == 0:
                    self.outer[self.phase] = self.outer.get(self.phase, 0.0) + end - t
                if self.spans is not None:
                    self.spans.append(("vLLM's thread", short, t, end))

        return timed

    def _job(self, kind: str, fn: Any) -> None:
        t, cpu = time.perf_counter(), time.thread_time()
        job_prof = self.job_profiles.get(kind)
        on = job_prof is not None and self._enable(job_prof)
        try:
            fn()
        finally:
            if on:
                job_prof.disable()  # type: ignore[union-attr]
            end = time.perf_counter()
            self.jobs.append((kind, t, end, time.thread_time() - cpu))
            if self.spans is not None:
                thread = "commit thread" if kind == "commit" else "copy thread"
                self.spans.append((thread, f"{kind} job", t, end))

    def _enable(self, profile: Any) -> bool:
        """Enable ``profile``; ``False`` (this call is not profiled) when another profile is
        active: from Python 3.12 on, one profiler at a time per process, every thread."""
        try:
            profile.enable()
        except ValueError:
            self.skipped_profiles += 1
            return False
        return True

    def request(self, start: float, ttft: float) -> None:
        if self.out is not None:
            self.requests.append((self.phase, start, ttft))

    def _overlaps(self, label: str) -> None:
        """Per request of phase ``label``: save jobs whose run overlapped its TTFT window."""
        for _, start, ttft in (r for r in self.requests if r[0] == label):
            end = start + ttft
            parts = []
            for kind, a, b, cpu in self.jobs:
                inside = min(b, end) - max(a, start)
                if inside > 0:
                    parts.append(f"{kind} {1e3 * inside:.1f} ms wall/{1e3 * cpu:.1f} ms CPU")
            self.rows.append(
                f"  TTFT {1e3 * ttft:6.1f} ms; inside it: " + ("; ".join(parts) or "-")
            )

    def run(self, label: str, fn: Any) -> Any:
        if self.out is None:
            return fn()
        import cProfile
        import pstats
        import threading

        self.phase = label
        cpu0 = _thread_cpu()
        prof = cProfile.Profile()
        t = time.perf_counter()
        if self.cprofile:
            prof.enable()
        try:
            return fn()
        finally:
            prof.disable()
            wall = time.perf_counter() - t
            cpu1 = _thread_cpu()
            names = {th.native_id: th.name for th in threading.enumerate()}
            busy = sorted(
                ((cpu1[tid] - cpu0.get(tid, 0.0), names.get(tid, str(tid))) for tid in cpu1),
                reverse=True,
            )
            self.rows.append(
                f"[{label}] wall {wall:.3f} s; thread CPU s: "
                + ", ".join(f"{n}={c:.3f}" for c, n in busy[:8] if c > 0.001)
            )
            for (ph, name), (sec, calls) in sorted(self.hooks.items()):
                if ph == label:
                    self.rows.append(f"  {name:<48} {1e3 * sec:9.1f} ms  {calls:6d} calls")
            self._overlaps(label)
            if self.cprofile:
                path = self.out / f"{label}.txt"
                with path.open("w") as f:
                    stats = pstats.Stats(prof, stream=f)
                    stats.sort_stats("tottime").print_stats(40)
                    stats.sort_stats("cumulative").print_stats(60)
                if label.startswith("lmcache"):
                    prof.dump_stats(str(self.out / f"{label}.prof"))

    def report(self) -> None:
        import pstats

        for row in self.rows:
            print(row)
        if self.skipped_profiles:
            print(f"cProfile: {self.skipped_profiles} calls not profiled (another was active)")
        profiles = [("hook-" + n, p) for n, p in self.hook_profiles.items()]
        profiles += [("job-" + k, p) for k, p in self.job_profiles.items()]
        for label, profile in profiles:  # every phase together
            assert self.out is not None
            with (self.out / f"{label}.txt").open("w") as f:
                try:
                    stats = pstats.Stats(profile, stream=f)
                except TypeError:  # never enabled
                    continue
                stats.sort_stats("tottime").print_stats(30)
                stats.sort_stats("cumulative").print_stats(50)


def _thread_cpu() -> dict[int, float]:
    """CPU seconds (user + system) of every thread of this process, by native id."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return out


_MARKER = "spin_kernel"  # torch.cuda._sleep's kernel: aligns the trace's clock with the host's


def _gpu_time(
    trace: Path,
    host0: float | None = None,
    spans: Sequence[tuple[str, str, float, float]] = (),
    timeline: bool = False,
) -> str:
    """Where the GPU's time went in a ``torch.profiler`` Chrome trace (CUDA activity): kernel
    time per stream (the busiest is vLLM's), idle time between kernels, copies per stream.

    With ``host0`` (``time.perf_counter()`` when the :data:`_MARKER` kernel was launched on an
    idle GPU) and ``spans`` (``(thread, what, start, end)`` host intervals), also which of them
    overlapped the GPU's waits over 0.1 ms (up to 5 ms, and longer), and with ``timeline`` one
    request's waits and host spans. Always: when vLLM's own device-to-host copies started late
    while a big copy on another stream ran.

    The marker aligns the clocks only roughly: on the first engine traced in a process the host
    spans were seen 10-45 ms off (vLLM's ``execute_model`` placed after the kernels it launched),
    so check a timeline against such landmarks before reading it."""
    import collections
    import json

    events = [
        e
        for e in json.loads(trace.read_text())["traceEvents"]
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy")
    ]
    markers = [e for e in events if _MARKER in e.get("name", "")]
    events = [e for e in events if _MARKER not in e.get("name", "")]
    kernels = sorted((e for e in events if e["cat"] == "kernel"), key=lambda e: e["ts"])
    if not kernels:
        return "no kernels traced"
    per: dict[tuple[str, Any], float] = collections.defaultdict(float)
    for e in events:
        per[(e["cat"], e.get("args", {}).get("stream"))] += e["dur"]
    main = max((k for k in per if k[0] == "kernel"), key=lambda k: per[k])
    idle = _idle_gaps(kernels)
    gaps = [hi - lo for lo, hi, _, _ in idle]
    waits = [(lo, hi) for lo, hi, _, _ in idle if hi - lo > 100]  # over 0.1 ms, trace us
    where: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for lo, hi, before, after in idle:
        if 100 < hi - lo <= 5000:  # inside a step: between which kernels
            cell = where[(_short(kernels[before]["name"]), _short(kernels[after]["name"]))]
            cell[0] += 1
            cell[1] += hi - lo
    bins = ((0, 100), (100, 1000), (1000, 5000), (5000, float("inf")))  # microseconds
    hist = ", ".join(
        f"{'>' if b == float('inf') else ''}{(a if b == float('inf') else b) / 1e3:g} ms: "
        f"{sum(1 for g in gaps if a < g <= b)} = "
        f"{sum(g for g in gaps if a < g <= b) / 1e3:.1f} ms"
        for a, b in bins
    )
    span = max(e["ts"] + e["dur"] for e in kernels) - kernels[0]["ts"]
    busy = span - sum(gaps)
    other = sum(v for k, v in per.items() if k[0] == "kernel" and k != main)
    copies = ", ".join(
        f"stream {k[1]} {v / 1e3:.1f} ms" for k, v in sorted(per.items()) if k[0] == "gpu_memcpy"
    )
    text = (
        f"span {span / 1e3:.1f} ms, kernels busy {busy / 1e3:.1f} ms (vLLM's stream "
        f"{per[main] / 1e3:.1f}, other streams {other / 1e3:.1f}), idle {(span - busy) / 1e3:.1f} "
        f"ms (gaps up to {hist}); copies: {copies}"
    )
    top = sorted(where.items(), key=lambda kv: -kv[1][1])[:5]
    text += "\n    gaps of 0.1-5 ms, after -> before kernel: " + "; ".join(
        f"{a} -> {b}: {n} = {t / 1e3:.1f} ms" for (a, b), (n, t) in top
    )
    if host0 is not None and markers:
        offset = markers[0]["ts"] - host0 * 1e6  # trace us = host s * 1e6 + offset
        if timeline:
            text += "\n    " + _timeline(kernels, offset, spans)
        small = [w for w in waits if w[1] - w[0] <= 5000]
        large = [w for w in waits if w[1] - w[0] > 5000]
        text += "\n    " + _attribute(small, offset, spans, "0.1-5 ms")
        text += "\n    " + _attribute(large, offset, spans, "over 5 ms")
    text += "\n    " + _copy_lag(events, main[1])
    return text


def _timeline(
    kernels: Sequence[dict[str, Any]],
    offset: float,
    spans: Sequence[tuple[str, str, float, float]],
) -> str:
    """One request (the third run of kernels between GPU waits over 5 ms) on one clock: its
    GPU waits over 0.1 ms and the host spans from 5 ms before its first kernel to its last."""
    bounds = [0] + [after for lo, hi, _, after in _idle_gaps(kernels) if hi - lo > 5000]
    runs = [kernels[a:b] for a, b in itertools.pairwise([*bounds, len(kernels)])]
    run = runs[min(2, len(runs) - 1)]
    t0 = run[0]["ts"]
    end = max(e["ts"] + e["dur"] for e in run)
    rows = [f"one request's GPU work ({len(runs)} runs, the 3rd): {(end - t0) / 1e3:.1f} ms"]
    for lo, hi, before, after in _idle_gaps(run):
        if hi - lo > 100:
            rows.append(
                f"  GPU idle +{(lo - t0) / 1e3:.2f} ms for {(hi - lo) / 1e3:.2f} ms: "
                f"{_short(run[before]['name'])} -> {_short(run[after]['name'])}"
            )
    for thread, what, a, b in sorted(spans, key=lambda sp: sp[2]):
        ta, tb = a * 1e6 + offset, b * 1e6 + offset
        if tb >= t0 - 5000 and ta <= end and tb - ta > 20:
            rows.append(
                f"  host {thread}: {what} +{(ta - t0) / 1e3:.2f} .. +{(tb - t0) / 1e3:.2f} ms"
            )
    return "\n    ".join(rows)


def _idle_gaps(kernels: Sequence[dict[str, Any]]) -> list[tuple[float, float, int, int]]:
    """``(start, end, index of the kernel before, index of the kernel after)`` of every time the
    GPU ran no kernel, on any stream, between ``kernels`` (sorted by start; trace
    microseconds)."""
    out = []
    hi, last = kernels[0]["ts"], 0
    for i, e in enumerate(kernels):  # the union of kernel intervals over every stream
        if e["ts"] > hi:
            out.append((hi, e["ts"], last, i))
        if e["ts"] + e["dur"] >= hi:
            hi, last = e["ts"] + e["dur"], i
    return out


def _short(name: str) -> str:
    """A kernel's name without its template arguments and parameters, at most 40 chars."""
    return name.split("<", 1)[0].split("(", 1)[0].rsplit("::", 1)[-1][:40]


def _attribute(
    waits: Sequence[tuple[float, float]],
    offset: float,
    spans: Sequence[tuple[str, str, float, float]],
    label: str,
) -> str:
    """Which host spans overlapped the GPU's waits (trace microseconds), most first (a hook
    called inside another, e.g. an in-process lookup inside ``get_num_new_matched_tokens``,
    counts in both)."""
    overlap: dict[tuple[str, str], float] = {}
    for lo, hi in waits:
        a, b = (lo - offset) / 1e6, (hi - offset) / 1e6
        for thread, what, start, end in spans:
            inside = min(end, b) - max(start, a)
            if inside > 0:
                overlap[(thread, what)] = overlap.get((thread, what), 0.0) + inside
    total = sum(hi - lo for lo, hi in waits) / 1e3
    top = sorted(overlap.items(), key=lambda kv: -kv[1])[:12]
    found = ", ".join(f"{thread}: {what} {1e3 * sec:.1f} ms" for (thread, what), sec in top)
    return f"GPU waits {label}: {len(waits)}, {total:.1f} ms; host work inside: {found or 'none'}"


def _copy_lag(events: Sequence[dict[str, Any]], main_stream: Any) -> str:
    """vLLM's own device-to-host copies (streams without a copy over 64 MiB): how late each
    started after the last kernel on vLLM's stream before it, and how many overlapped a copy
    of another stream over 64 MiB (lmcache's saves)."""
    import bisect

    copies = [e for e in events if e["cat"] == "gpu_memcpy" and "DtoH" in e.get("name", "")]
    big = [e for e in copies if int(e.get("args", {}).get("bytes", 0)) > 64 << 20]
    big_streams = {e.get("args", {}).get("stream") for e in big}
    own = [e for e in copies if e.get("args", {}).get("stream") not in big_streams]
    ends = sorted(
        e["ts"] + e["dur"]
        for e in events
        if e["cat"] == "kernel" and e.get("args", {}).get("stream") == main_stream
    )
    lags, during = [], 0
    for e in own:
        i = bisect.bisect_right(ends, e["ts"])
        if i:
            lags.append(e["ts"] - ends[i - 1])
        if any(b["ts"] < e["ts"] + e["dur"] and e["ts"] < b["ts"] + b["dur"] for b in big):
            during += 1
    if not lags:
        return "vLLM's device-to-host copies: none traced"
    lags.sort()
    return (
        f"vLLM's device-to-host copies: {len(own)}, {during} while a copy over 64 MiB ran; "
        f"start after vLLM's last kernel: median {lags[len(lags) // 2] / 1e3:.2f} ms, "
        f"max {lags[-1] / 1e3:.2f} ms, sum {sum(lags) / 1e3:.1f} ms"
    )


def _traced(fn: Any, prof: _Profile, timeline: bool = False) -> tuple[Any, str]:
    """``(fn(), _gpu_time of the GPU work while it ran)``, with ``prof.spans`` attributed."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as tracer:
        torch.cuda.synchronize()
        host0: float | None = time.perf_counter()
        try:
            torch.cuda._sleep(1000)  # type: ignore[no-untyped-call]  # the clock marker
        except (AttributeError, RuntimeError):  # no marker: no attribution
            host0 = None
        torch.cuda.synchronize()
        if prof.spans is not None:
            prof.spans.clear()
        out = fn()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        tracer.export_chrome_trace(str(path))
        return out, _gpu_time(path, host0, prof.spans or (), timeline)


def _measure(
    llm: Any,
    prompts: list[list[int]],
    batches: list[list[list[int]]],
    prof: _Profile,
    tag: str,
    trace: bool = False,
) -> dict[str, list[float]]:
    _ttft(llm, prompts[-1][:512])  # warm-up (distinct tokens)

    def cold_run() -> list[tuple[float, float]]:
        return [_ttft(llm, p, prof) for p in prompts[:-1]]

    if trace:
        cold, gpu = _traced(cold_run, prof, timeline=True)
        print(f"{tag}: GPU during the cold requests: {gpu}", flush=True)
    else:
        cold = prof.run(f"{tag}-cold", cold_run)
    llm.reset_prefix_cache()
    warm = prof.run(f"{tag}-warm", lambda: [_ttft(llm, p, prof) for p in prompts[:-1]])

    def tput_run() -> list[float]:
        return [_throughput(llm, b) for b in batches]

    if trace:
        tputs, gpu = _traced(tput_run, prof)
        print(f"{tag}: GPU during the throughput batches: {gpu}", flush=True)
    else:
        tputs = prof.run(f"{tag}-tput", tput_run)
    print(
        f"{tag}: TTFT per request (ms), cold "
        + " ".join(f"{1e3 * t:.1f}" for t, _ in cold)
        + "; warm "
        + " ".join(f"{1e3 * t:.1f}" for t, _ in warm)
        + "; throughput per batch (tok/s) "
        + " ".join(f"{x:.0f}" for x in tputs),
        flush=True,
    )
    return {
        "cold": [t for t, _ in cold],
        "warm": [t for t, _ in warm],
        "cold_wall": [w for _, w in cold],
        "warm_wall": [w for _, w in warm],
        "tput": tputs,
    }


def _pooled(rounds: list[dict[str, list[float]]]) -> dict[str, float]:
    """Medians over every round's samples of one engine."""
    return {
        name: statistics.median(x for r in rounds for x in r[name])
        for name in ("cold", "warm", "cold_wall", "warm_wall", "tput")
    }


_VARIANTS = ("base", "lmcache", "no-save")


@contextlib.contextmanager
def _fresh_engine(variant: str, model: Path, kv: dict[str, Any], max_len: int) -> Iterator[Any]:
    """A fresh engine of ``variant`` (``base``: vLLM alone; ``lmcache``: with ``kv``;
    ``no-save``: ``kv`` as ``kv_consumer``, lookups only) over an empty process tier, its host
    pool pinned before it is used (pinning is not what this measures); shut down after."""
    from lmcache.tiers import reset_process_cpu_tiers
    from lmcache_vllm.vllm_v1_adapter import live_engines

    if variant not in _VARIANTS:
        raise SystemExit(f"unknown engine variant {variant!r}; expected one of {_VARIANTS}")
    config: dict[str, Any] | None = None
    if variant != "base":
        config = dict(kv)
        if variant == "no-save":
            config["kv_role"] = "kv_consumer"
    reset_process_cpu_tiers()
    llm = _engine(model, config, max_len)
    try:
        for engine in live_engines():
            engine.pool.wait_prepinned(timeout=300)
        yield llm
    finally:
        _shutdown(llm)


def _run_engine(
    variant: str,
    model: Path,
    kv: dict[str, Any],
    max_len: int,
    prompts: list[list[int]],
    batches: list[list[list[int]]],
    prof: _Profile,
    tag: str,
    trace: bool = False,
) -> dict[str, list[float]]:
    """:func:`_measure` on a :func:`_fresh_engine` of ``variant``; lmcache's counters printed."""
    from lmcache_vllm.vllm_v1_adapter import live_engines

    with _fresh_engine(variant, model, kv, max_len) as llm:
        out = _measure(llm, prompts, batches, prof, tag, trace)
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


def _cold_variant(
    variant: str, model: Path, kv: dict[str, Any], max_len: int, prompts: list[list[int]]
) -> float:
    """Median cold TTFT of ``prompts[:-1]`` on a :func:`_fresh_engine` of ``variant``."""
    with _fresh_engine(variant, model, kv, max_len) as llm:
        _ttft(llm, prompts[-1][:512])
        cold = [_ttft(llm, p)[0] for p in prompts[:-1]]
    print(f"{variant}: cold TTFT per request (ms) " + " ".join(f"{1e3 * t:.1f}" for t in cold))
    return statistics.median(cold)


def _first_prefix_hit(model: Path, max_len: int, prompts: list[list[int]]) -> None:
    """vLLM alone, a fresh process: cold prompts, then the same prompts again without a reset
    (vLLM's own prefix-cache hits), every TTFT printed."""
    with _fresh_engine("base", model, {}, max_len) as llm:
        _ttft(llm, prompts[-1][:512])
        cold = [_ttft(llm, p)[0] for p in prompts[:-1]]
        hits = [_ttft(llm, p)[0] for p in prompts[:-1]]
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


def _parts(
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
    from lmcache_vllm.scheduler import SchedulerSide
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
    prof = _Profile(Path(tempfile.mkdtemp(prefix="lmcache-parts-")), cprofile=False)
    seed = itertools.count(50_000, batch)
    # Python's garbage collections per phase (any thread; they stop every thread): seconds,
    # full (generation 2) collections
    collected: dict[str, list[float]] = {}

    def _gc(generation: int, start: float, end: float) -> None:
        rec = collected.setdefault(prof.phase, [0.0, 0.0])
        rec[0] += end - start
        rec[1] += generation == 2

    untimed = _on_gc(_gc)

    def _batch() -> list[list[int]]:
        first = next(seed)
        return [make_prompt(2048, seed=first + i, vocab_size=32000) for i in range(batch)]

    # (engine, variant) -> [(tok/s, {hook: s})], in cycle order
    got: dict[tuple[str, str], list[tuple[float, dict[str, float]]]] = {}
    for rnd in range(rounds):
        for kind in ("base", "lmcache") if rnd % 2 == 0 else ("lmcache", "base"):
            tag = f"{kind}{rnd + 1}"
            with _fresh_engine(kind, model, kv, max_len) as llm:
                for _ in range(2):
                    _throughput(llm, _batch())  # warm-up
                order = list(_PARTS)
                for cycle in range(cycles):
                    order = order[1:] + order[:1] if cycle % 2 else order[::-1]
                    for name in order:
                        switch["saves"], switch["lookups"] = _PARTS[name]
                        prof.phase = "skip"
                        _throughput(llm, _batch())  # takes the last variant's tail
                        key = (tag, name if kind == "lmcache" else "alone")
                        prof.phase = f"{key}{cycle}"
                        tput = _throughput(llm, _batch())
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32, help="2k-token prompts per batch")
    parser.add_argument(
        "--tput-reps",
        type=int,
        default=1,
        help="throughput batches per engine, each of new prompts; the median is reported",
    )
    parser.add_argument(
        "--checksum",
        choices=("default", "on", "off"),
        default="default",
        help="lmcache's checksum setting (default: unset, which is off for CUDA engines)",
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
        "machine), lmcache (the default again), no-save (kv_role kv_consumer: lookups only)",
    )
    parser.add_argument("--cold-reps", type=int, default=15)
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="fresh engines per variant, in ABBA order (base, lmcache, lmcache, base, ...); the "
        "figures are medians over every round's samples, and each round's ratios are printed",
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
    if args.sync_saves:
        from lmcache_vllm.save_queue import SaveQueue

        def _inline(self: SaveQueue, req_id: str, copy: Any, fence: Any = None) -> None:
            commit = copy()
            if callable(commit):
                commit()

        SaveQueue.submit = _inline  # type: ignore[method-assign]

    import torch

    from lmcache_vllm.testing import build_tiny_llama, make_prompt

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
    batches = [
        [
            make_prompt(2048, seed=1000 + r * args.batch + i, vocab_size=32000)
            for i in range(args.batch)
        ]
        for r in range(args.tput_reps)
    ]
    max_len = args.tokens + 64
    print(
        f"{torch.cuda.get_device_name()}, vLLM {vllm.__version__}, random Llama: 8 layers, "
        f"Llama-3-8B attention (32 q / 8 kv heads of 128), bf16, prompt {args.tokens} tokens"
    )

    if args.first_prefix_hit:
        _first_prefix_hit(model, max_len, prompts)
        return
    prof = _Profile(
        args.profile,
        cprofile=not args.no_cprofile,
        hooks=[h for h in args.cprofile_hooks.split(",") if h],
        jobs=args.cprofile_jobs,
        spans=args.gpu_trace,
    )
    extra: dict[str, Any] = {"lmcache.max_local_cpu_size": 8.0}
    if args.checksum != "default":
        extra["lmcache.checksum"] = args.checksum == "on"
    kv = {
        "kv_connector": "LMCacheConnectorV1",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }
    if args.parts:
        _parts(model, kv, max_len, args.rounds, args.parts, args.batch)
        return
    samples: dict[str, list[dict[str, list[float]]]] = {"base": [], "lmcache": []}
    for rnd in range(args.rounds):
        # ABBA: the machine's drift over a run weighs on both engines alike
        order = ("base", "lmcache") if rnd % 2 == 0 else ("lmcache", "base")
        for variant in order:
            tag = variant if args.rounds == 1 else f"{variant}{rnd + 1}"
            samples[variant].append(
                _run_engine(
                    variant, model, kv, max_len, prompts, batches, prof, tag, args.gpu_trace
                )
            )
    base, lm = _pooled(samples["base"]), _pooled(samples["lmcache"])
    if args.rounds > 1:
        for rnd in range(args.rounds):
            b, m = (
                _pooled(samples["base"][rnd : rnd + 1]),
                _pooled(samples["lmcache"][rnd : rnd + 1]),
            )
            print(
                f"round {rnd + 1}: cold {1e3 * b['cold']:.1f} / {1e3 * m['cold']:.1f} ms "
                f"({100 * (m['cold'] / b['cold'] - 1):+.1f} %), warm {b['warm'] / m['warm']:.2f}x, "
                f"throughput {100 * m['tput'] / b['tput']:.1f} %"
            )

    prof.report()
    for variant in filter(None, args.cold_variants.split(",")):
        seeds = range(5000 + 100 * len(variant), 5000 + 100 * len(variant) + args.cold_reps + 1)
        cold_prompts = [make_prompt(args.tokens, seed=s, vocab_size=32000) for s in seeds]
        med = _cold_variant(variant, model, kv, max_len, cold_prompts)
        print(
            f"variant {variant:<12} cold TTFT median of {args.cold_reps}: {1e3 * med:.1f} ms "
            f"({100 * (med / base['cold'] - 1):+.1f} % against vLLM alone above)",
            flush=True,
        )
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
        f"{'generate() wall, cold / warm (ms)':<34} "
        f"{1e3 * base['cold_wall']:>5.1f}/{1e3 * base['warm_wall']:<5.1f} "
        f"{1e3 * lm['cold_wall']:>5.1f}/{1e3 * lm['warm_wall']:<5.1f}  "
        f"(TTFT + this process's detokenization; warm {base['warm_wall'] / lm['warm_wall']:.2f}x)"
    )
    print(
        "TTFT: vLLM's RequestOutput.metrics.first_token_latency (vllm:time_to_first_token_seconds)"
    )
    print(
        f"checksum: {args.checksum} ({'on' if args.checksum == 'on' else 'off'} here); saves: "
        f"{'inline (synchronous)' if args.sync_saves else 'off the step (default)'}"
    )


if __name__ == "__main__":
    main()
