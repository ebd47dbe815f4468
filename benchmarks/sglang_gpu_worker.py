# SPDX-License-Identifier: Apache-2.0
"""One engine of ``sglang_gpu.py``, in a process of its own: ``python sglang_gpu_worker.py SPEC``.

SGLang's ``Engine.shutdown()`` kills every child process of its caller, so each engine runs in
this script, one at a time. The spec (JSON, written by ``sglang_gpu.py``) names the engine's
keyword arguments, the prompts and what to measure; the result (JSON) is rewritten after every
step, so that a crash or a timeout still leaves what was measured.

SGLang spawns its scheduler, which imports this file as ``__mp_main__``: there the CPU
stand-ins for HiCache (``sglang_gpu_cpu.py``, on the CPU engine) and the trace
(``sglang_gpu_trace.py``) are installed before SGLang builds its caches.

Per engine: a warm-up round (the same steps on a prompt of its own, not counted: the first
request and the first load build kernels), then per prompt:

1. ``cold``: a prompt never seen (``max_new_tokens=1``: the wall time of ``generate()`` is the
   TTFT as the caller sees it);
2. ``backup``: for engines that store (HiCache with a storage backend, ``--enable-lmcache``),
   until the backend has the prompt's pages (from the trace: the end of the last store call
   minus the end of the request);
3. ``floor``: the same prompt again, a hit in SGLang's own device cache (one token computed:
   the decode step of the bound);
4. ``l2`` (HiCache engines): another prompt of the same size (it evicts the first from the
   device pool, which holds 1.5 prompts; the host pool holds 3), then the first again: a hit in
   HiCache's host tier, which nothing flushed;
5. ``flush``: ``flush_cache()`` once every backup has ended (how long the call took);
6. ``warm``: the prompt again, after the flush: a recompute for SGLang alone and for HiCache's
   host tier alone (the flush empties it), a load from storage (lmcache, SGLang's ``file``) or
   from lmcache (``--enable-lmcache``).

Then ``throughput``: batches of new prompts at once (0 % reuse), prompt tokens per second, after
one untimed batch (the first batch of a process builds kernels: without it, the first engine's
figure was half the others' on an H100).
Steps 4 and 6 are checked: a request that restored tokens must give the greedy token of
SGLang's own device hit (step 3: the last token computed over cached KV, which on a random model
may differ from a whole prefill's), one that restored none the cold request's. A device hit
that differs from the cold request is reported apart (``floor_differs``), not as an error.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CPU_ENV = "LMC_SGB_CPU"
"""``1``: install ``sglang_gpu_cpu.py``'s stand-ins in SGLang's processes (the CPU engine)."""

if __name__ == "__mp_main__":  # SGLang's scheduler (and detokenizer), spawned by the worker
    sys.path.insert(0, str(HERE))
    if os.environ.get(CPU_ENV) == "1":
        import sglang_gpu_cpu

        sglang_gpu_cpu.apply()
    if os.environ.get("LMC_SGB_TRACE"):
        import sglang_gpu_trace

        sglang_gpu_trace.install(
            os.environ["LMC_SGB_TRACE"], os.environ.get("LMC_SGB_TRACE_DETAIL") == "1"
        )

STORE_NAMES = ("batch_set_v1", "batch_set", "set", "store", "copy_out", "batch_stores")
STORE_NAMES += ("store_kv", "submit_store", "DeferredStores.commit")


def _flush(engine: Any, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        res = engine.flush_cache()
        if getattr(res, "success", res):
            return
        if time.monotonic() > deadline:
            raise RuntimeError("flush_cache() kept failing: SGLang never went idle")
        time.sleep(0.05)


class Run:
    """One engine's steps and samples (see the module docstring)."""

    def __init__(self, spec: dict[str, Any], engine: Any, result: dict[str, Any]) -> None:
        self.spec = spec
        self.engine = engine
        self.result = result
        self.samples: dict[str, list[float]] = result.setdefault("samples", {})
        self.phases: list[list[Any]] = result.setdefault("phases", [])
        self.trace = spec["trace_dir"]
        self.sampling = {"temperature": 0.0, "max_new_tokens": 1}

    def dump(self) -> None:
        Path(self.spec["out"]).write_text(json.dumps(self.result))

    def gen(self, prompt: list[int], label: str | None, rep: int) -> dict[str, Any]:
        t0 = time.time()
        out = self.engine.generate(input_ids=prompt, sampling_params=self.sampling)
        t1 = time.time()
        if label is not None:
            self.phases.append([label, rep, t0, t1])
            if rep > 0:
                self.samples.setdefault(label, []).append(t1 - t0)
                meta = out.get("meta_info", {})
                details = meta.get("cached_tokens_details") or {}
                hit = {k: int(v or 0) for k, v in details.items() if isinstance(v, (int, float))}
                hit["cached"] = int(meta.get("cached_tokens", 0) or 0)
                self.result.setdefault("hits", {}).setdefault(label, []).append(hit)
        return out

    def wait_backup(self, since: float, target: int | None, rep: int, req_end: float) -> None:
        """Until the backend holds ``target`` pages stored since ``since`` (or, without a
        target, until its stores have been quiet for 0.3 s); records the backup time."""
        import sglang_gpu_trace as trace

        t0 = time.time()
        deadline = time.monotonic() + self.spec["backup_timeout_s"]
        last = float("nan")
        while time.monotonic() < deadline:
            events = trace.read(self.trace)
            if target is not None:
                pages, last = trace.stored_pages(events, since)
                if pages >= target and trace.in_flight(events) == 0:
                    break
            else:
                last = trace.last_end(events, since, STORE_NAMES)
                quiet = time.time() - last >= 0.3 if last == last else False
                if quiet and trace.in_flight(events) == 0:
                    break
            time.sleep(0.02)
        else:
            self.result.setdefault("notes", []).append(
                f"backup of rep {rep} not complete after {self.spec['backup_timeout_s']} s"
            )
            last = float("nan")
        self.phases.append(["backup", rep, t0, time.time()])
        if rep > 0:
            self.samples.setdefault("backup", []).append(max(0.0, last - req_end))

    def quiet(self, rep: int) -> None:
        """Until no lmcache call is in flight and none ended in the last 0.3 s."""
        import sglang_gpu_trace as trace

        t0 = time.time()
        deadline = time.monotonic() + self.spec["backup_timeout_s"]
        while time.monotonic() < deadline:
            events = trace.read(self.trace)
            ends = [e["t1"] for e in events if "t1" in e and e.get("kind") != "sgl"]
            if trace.in_flight(events) == 0 and (not ends or time.time() - max(ends) >= 0.3):
                break
            time.sleep(0.02)
        self.phases.append(["quiet", rep, t0, time.time()])

    def same(self, rep: int, label: str, ref: dict[str, Any], out: dict[str, Any]) -> None:
        """Count whether ``out``'s greedy token equals ``ref``'s (a wrong page loaded would
        change it)."""
        key = "same" if out.get("output_ids") == ref.get("output_ids") else "differs"
        self.result.setdefault(key, []).append(f"{label}{rep}")

    def same_hit(
        self, rep: int, label: str, cold: dict[str, Any], floor: dict[str, Any], out: dict[str, Any]
    ) -> None:
        """A request that restored tokens computes its last token over cached KV, as SGLang's
        own device hit (``floor``) does: compared with that. One that restored none is a
        recompute: compared with the cold request."""
        restored = int((out.get("meta_info") or {}).get("cached_tokens", 0) or 0) > 0
        self.same(rep, label, floor if restored else cold, out)

    def round(self, rep: int, prompt: list[int], filler: list[int]) -> None:
        spec = self.spec
        out = self.gen(prompt, "cold", rep)
        req_end = self.phases[-1][3]
        if spec["stores"]:
            target = (len(prompt) - 1) // spec["page_size"] if spec["hicache_storage"] else None
            self.wait_backup(self.phases[-1][2], target, rep, req_end)
        floor = self.gen(prompt, "floor", rep)
        if floor.get("output_ids") != out.get("output_ids"):  # SGLang's own numerics
            self.result.setdefault("floor_differs", []).append(f"floor{rep}")
        if spec["hicache"]:
            self.gen(filler, "filler", rep)
            self.same_hit(rep, "l2", out, floor, self.gen(prompt, "l2", rep))
        if spec["stores"]:
            self.quiet(rep)
        t0 = time.time()
        _flush(self.engine)
        t1 = time.time()
        self.phases.append(["flush", rep, t0, t1])
        if rep > 0:
            self.samples.setdefault("flush", []).append(t1 - t0)
        self.same_hit(rep, "warm", out, floor, self.gen(prompt, "warm", rep))
        self.dump()

    def throughput(self, batches: list[list[list[int]]]) -> None:
        """Batch 0 warms the batch path up (its first use builds kernels); the others are timed."""
        if batches:
            self.engine.generate(input_ids=batches[0], sampling_params=self.sampling)
            batches = batches[1:]
        for i, batch in enumerate(batches):
            t0 = time.time()
            self.engine.generate(input_ids=batch, sampling_params=self.sampling)
            t1 = time.time()
            self.phases.append(["tput", i + 1, t0, t1])
            self.samples.setdefault("tput", []).append(sum(map(len, batch)) / (t1 - t0))
            self.dump()
        if self.spec["stores"]:
            self.quiet(len(batches))


def run_worker(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    result: dict[str, Any] = {"engine": spec["engine"], "error": None}
    out = Path(spec["out"])

    def dump() -> None:
        out.write_text(json.dumps(result))

    sys.path.insert(0, str(HERE))
    Path(spec["trace_dir"]).mkdir(parents=True, exist_ok=True)
    os.environ["LMC_SGB_TRACE"] = spec["trace_dir"]  # inherited by SGLang's scheduler
    os.environ["LMC_SGB_TRACE_DETAIL"] = "1" if spec["trace"] else "0"
    os.environ[CPU_ENV] = "1" if spec["device"] == "cpu" else "0"
    for key, value in spec.get("env", {}).items():
        os.environ[key] = value
    t0 = time.monotonic()
    engine = None
    try:
        import sglang as sgl

        result["sglang"] = getattr(sgl, "__version__", "?")
        dump()  # SGLang kills this process (SIGKILL) when its scheduler fails to start
        engine = sgl.Engine(**spec["kwargs"])
        result["start_s"] = round(time.monotonic() - t0, 1)
        dump()
        run = Run(spec, engine, result)
        prompts, fillers = spec["prompts"], spec["fillers"]
        for rep, (prompt, filler) in enumerate(zip(prompts, fillers, strict=True)):
            if time.monotonic() - t0 > spec["engine_budget_s"] and rep > 1:
                result.setdefault("notes", []).append(f"budget: stopped after {rep - 1} prompts")
                break
            run.round(rep, prompt, filler)
        run.throughput(spec["batches"])
        result["measure_s"] = round(time.monotonic() - t0 - result["start_s"], 1)
    except BaseException as exc:
        import traceback

        result["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"
        dump()
        return 1
    finally:
        if engine is not None:
            try:
                engine.shutdown()
            except Exception as exc:
                result["shutdown_error"] = repr(exc)
        result["total_s"] = round(time.monotonic() - t0, 1)
        dump()
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} SPEC_JSON (started by sglang_gpu.py)")
    sys.exit(run_worker(sys.argv[1]))
