# SPDX-License-Identifier: Apache-2.0
"""``vllm_gpu.py --profile`` and ``--gpu-trace``'s host side: where lmcache's time goes in vLLM.

:class:`Profile` times lmcache's scheduler- and worker-side hooks per phase on vLLM's thread,
keeps the main thread's cProfile of each phase, CPU seconds per thread, and the save jobs that ran
inside each request's TTFT; with ``spans`` it records ``(thread, what, start, end)`` host spans
that :mod:`vllm_gpu_trace` lays beside the GPU's waits. :func:`on_gc` reports Python's garbage
collections. Both patch lmcache's classes for the rest of the process: for profiling runs only.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def on_gc(record: Callable[[int, float, float], None]) -> Callable[[str, dict[str, Any]], None]:
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


class Profile:
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
        from lmcache_vllm.scheduler.side import SchedulerSide
        from lmcache_vllm.worker.batched_saves import BatchedSaves
        from lmcache_vllm.worker.loads import RequestLoads
        from lmcache_vllm.worker.save_queue import SaveQueue
        from lmcache_vllm.worker.side import WorkerSide

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

        for cls in (SchedulerSide, WorkerSide, BatchedSaves, RequestLoads):
            for name, fn in list(vars(cls).items()):
                if name.startswith("__") or not callable(fn):
                    continue
                setattr(cls, name, self._wrap(f"{cls.__name__}.{name}", fn))
        if spans:
            import importlib

            from lmcache.cache_engine import StagedStore
            from lmcache_vllm.worker.save_queue import QuietGate

            # the parts of a commit job: asleep (copy, gate) or publishing
            StagedStore.commit = self._span("publish", StagedStore.commit)  # type: ignore[method-assign]
            QuietGate.wait = self._span("gate wait", QuietGate.wait)  # type: ignore[method-assign]

            def _gc(generation: int, start: float, end: float) -> None:  # Python's collections
                if self.spans is not None:
                    self.spans.append(("gc", f"gc gen{generation}", start, end))

            on_gc(_gc)
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
                if not label.startswith(("base", "offload")):  # an lmcache engine's phase
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
