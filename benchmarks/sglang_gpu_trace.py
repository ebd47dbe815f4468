# SPDX-License-Identifier: Apache-2.0
"""``sglang_gpu.py``'s trace: lmcache's calls inside SGLang's scheduler, timed per call.

:func:`install` runs in SGLang's scheduler process (the engine worker script imported as
``__mp_main__``, see ``sglang_gpu_worker.py``) and wraps, by class and module attribute:

- the *hooks* SGLang calls: the HiCache storage backends' methods (lmcache's
  ``LMCacheHiCacheStorage`` and SGLang's own ``HiCacheFile``: ``batch_exists``,
  ``batch_get_v1``, ``batch_set_v1``, ``batch_get``, ``batch_set``, ``get``, ``set``,
  ``exists``) and ``--enable-lmcache``'s connectors (every public method, and the commits of
  0.5.17's stores on their own thread);
- with ``detail`` (``--trace``), what lmcache does inside them: ``PageStore``'s key hashing,
  lookups, leases, loads and stores, the tier cascade (``stored_prefix``, ``hit_run``,
  ``keys_to_store``, ``publish``), the CPU tier (``allocate``, ``checksums``, ``get``, ``put``),
  the connector's copies (``from_gpu``, ``to_gpu``), the cache engine's calls; and SGLang's own
  storage steps around them (``_storage_hit_query``, ``_page_transfer``, ``_page_backup``, the
  host pool's device copies), recorded apart.

A hook call on a thread that is in no other hook call is an *event*: one JSON line with its
start and end (``time.time()``, comparable with the worker's clock), the pages it was given,
the thread, and the inclusive seconds and calls of each inner step. Events go to
``$LMC_SGB_TRACE/trace-<pid>.jsonl`` as they end (a ``b`` line marks a start, so that a reader
knows what is in flight). :func:`read` loads them; :func:`summary` adds them up over a window.
The wrappers cost a few microseconds per call: figures of traced runs are not for the table.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ENV = "LMC_SGB_TRACE"
"""Folder of the trace files; set by the worker, inherited by SGLang's scheduler."""
DETAIL_ENV = "LMC_SGB_TRACE_DETAIL"
"""``1``: wrap lmcache's and SGLang's inner steps too (``--trace``)."""

_HOOKS = ("batch_exists", "exists", "batch_get_v1", "batch_set_v1", "batch_get", "batch_set")
_HOOKS += ("get", "set")
_STORE_HOOKS = ("batch_set_v1", "batch_set", "set")
"""Hooks that write pages into the storage backend (the backup)."""

_local = threading.local()
_lock = threading.Lock()
_file: Any = None


def _emit(record: dict[str, Any]) -> None:
    with _lock:
        _file.write(json.dumps(record) + "\n")
        _file.flush()


def _pages(args: tuple[Any, ...]) -> int | None:
    first = args[1] if len(args) > 1 else None  # args[0] is self
    if isinstance(first, (list, tuple)):
        return len(first)
    return 1 if isinstance(first, str) else None


def _wrap_hook(owner: Any, name: str, label: str, pages: bool = True) -> None:
    fn = getattr(owner, name, None)  # inherited ones too (HiCacheFile's batch_exists)
    if fn is None or getattr(fn, "_sgb", False):
        return

    @functools.wraps(fn)
    def hook(*args: Any, **kwargs: Any) -> Any:
        if getattr(_local, "event", None) is not None:  # a hook inside a hook: an inner step
            return _timed_inner(fn, label, args, kwargs)
        event: dict[str, Any] = {"sub": {}}
        _local.event = event
        t0 = time.time()
        th = threading.current_thread().name
        _emit({"b": label, "t0": t0, "th": th})
        try:
            return fn(*args, **kwargs)
        finally:
            _local.event = None
            event.update(n=label, t0=t0, t1=time.time(), pages=_pages(args) if pages else None)
            event["th"] = th
            _emit(event)

    hook._sgb = True  # type: ignore[attr-defined]
    setattr(owner, name, hook)


def _timed_inner(fn: Callable[..., Any], label: str, args: Any, kwargs: Any) -> Any:
    event = getattr(_local, "event", None)
    if event is None:
        return fn(*args, **kwargs)
    t = time.perf_counter()
    try:
        return fn(*args, **kwargs)
    finally:
        rec = event["sub"].setdefault(label, [0.0, 0])
        rec[0] += time.perf_counter() - t
        rec[1] += 1


def _wrap_inner(owner: Any, name: str, label: str) -> None:
    fn = getattr(owner, name, None)
    if fn is None or getattr(fn, "_sgb", False):
        return
    if isinstance(owner, type) and isinstance(owner.__dict__.get(name), staticmethod):
        return

    @functools.wraps(fn)
    def inner(*args: Any, **kwargs: Any) -> Any:
        return _timed_inner(fn, label, args, kwargs)

    inner._sgb = True  # type: ignore[attr-defined]
    setattr(owner, name, inner)


def _count_copies(cls: Any) -> None:
    """Count the connector's copies: ``copies (one per run)`` adds one per copy of the
    one-copy-per-run path (0.0 ms: a count), ``copies (indexed path)`` one per call that fell
    back to indexing (absent before that path existed)."""
    runs = getattr(cls, "_runs", None)
    if runs is None or getattr(runs, "_sgb", False):
        return

    @functools.wraps(runs)
    def counted(*args: Any, **kwargs: Any) -> Any:
        out = runs(*args, **kwargs)
        event = getattr(_local, "event", None)
        if event is not None:
            label = "copies (indexed path)" if out is None else "copies (one per run)"
            rec = event["sub"].setdefault(label, [0.0, 0])
            rec[1] += 1 if out is None else len(out)
        return out

    counted._sgb = True  # type: ignore[attr-defined]
    cls._runs = counted


def _wrap_sglang(owner: Any, name: str, label: str) -> None:
    """An SGLang step, recorded as its own event (``kind: sgl``), apart from lmcache's."""
    fn = owner.__dict__.get(name)
    if fn is None or getattr(fn, "_sgb", False):
        return

    @functools.wraps(fn)
    def step(*args: Any, **kwargs: Any) -> Any:
        t0 = time.time()
        try:
            return fn(*args, **kwargs)
        finally:
            _emit({"n": label, "t0": t0, "t1": time.time(), "kind": "sgl", "sub": {}})

    step._sgb = True  # type: ignore[attr-defined]
    setattr(owner, name, step)


def _public(cls: type) -> Iterable[str]:
    return [n for n, v in vars(cls).items() if callable(v) and not n.startswith("_")]


def install(folder: str, detail: bool) -> None:
    """Wrap the hooks (and with ``detail`` the inner steps); events go to ``folder``. A part
    that cannot be wrapped on this SGLang is skipped with a line on stderr, never an error in
    SGLang's process."""
    global _file
    _file = open(Path(folder) / f"trace-{os.getpid()}.jsonl", "a")  # noqa: SIM115
    for part in (_install_file, _install_lmcache) + ((_install_detail,) if detail else ()):
        try:
            part()
        except Exception as exc:
            print(f"sglang_gpu_trace: {part.__name__} skipped: {exc!r}", file=sys.stderr)


def _install_file() -> None:
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    for name in _HOOKS:
        _wrap_hook(HiCacheFile, name, f"file.{name}")


def _install_lmcache() -> None:
    from lmcache.cache_engine import LMCacheEngine
    from lmcache_sglang import hicache_backend, legacy_adapter, legacy_stores, mp_connector

    for name in _HOOKS:
        _wrap_hook(hicache_backend.LMCacheHiCacheStorage, name, f"lmc.{name}")
    connectors = (
        mp_connector.UnifiedLMCacheMPConnector,
        legacy_adapter.LMCacheMPConnector,
        legacy_adapter.LMCacheLayerwiseConnector,
    )
    for cls in connectors:
        for name in _public(cls):
            _wrap_hook(cls, name, f"{cls.__name__}.{name}", pages=False)
    if hasattr(legacy_stores, "DeferredStores"):  # 0.5.17's stores publish on their own thread
        _wrap_hook(legacy_stores.DeferredStores, "commit", "DeferredStores.commit", pages=False)
    for name in ("store", "retrieve", "lookup_and_lease", "copy_out", "batch_stores"):
        _wrap_hook(LMCacheEngine, name, f"engine.{name}", pages=False)  # the store thread


def _install_detail() -> None:
    from lmcache.cache_engine import LMCacheEngine
    from lmcache.tiers import cascade
    from lmcache.tiers.cpu_tier import CPUTier
    from lmcache_sglang import kernel_transfer, legacy_stores, page_store
    from lmcache_sglang.gpu_connector import SGLangKVConnector

    for name in ("key", "prefix_pages", "hold", "load", "store", "put_pages", "_write", "_touch"):
        _wrap_inner(page_store.PageStore, name, f"PageStore.{name}")
    for name in ("chunks", "release"):
        _wrap_inner(page_store.HeldPages, name, f"HeldPages.{name}")
    for name in ("stored_prefix", "hit_run", "keys_to_store", "publish", "write_through"):
        _wrap_inner(cascade, name, f"cascade.{name}")
    for name in (
        "allocate",
        "allocate_many",
        "checksums",
        "get",
        "get_many",
        "put",
        "touch_many",
        "missing",
    ):
        _wrap_inner(CPUTier, name, f"CPUTier.{name}")
    for name in ("from_gpu", "to_gpu", "synchronize", "_staged_slots"):
        _wrap_inner(SGLangKVConnector, name, f"connector.{name}")
    for name in ("index", "store", "_staging"):  # the kernel path's steps (--enable-lmcache)
        _wrap_inner(kernel_transfer.KernelTransfer, name, f"kernels.{name}")
    _wrap_inner(LMCacheEngine, "plan_store", "engine.plan_store")
    from lmcache.devices import cuda as cuda_backend

    for name in ("stream_synchronize", "event_synchronize"):  # host waits for the device
        _wrap_inner(cuda_backend.CudaBackend, name, f"cuda.{name}")
    if hasattr(legacy_stores, "DeferredStores"):
        _wrap_inner(legacy_stores.DeferredStores, "store", "DeferredStores.store")
    _count_copies(SGLangKVConnector)
    if hasattr(page_store, "chunk_checksum"):
        _wrap_inner(page_store, "chunk_checksum", "chunk_checksum")
    try:
        from sglang.srt.managers.cache_controller import HiCacheController

        for name in ("_storage_hit_query", "_page_transfer", "_page_backup"):
            _wrap_sglang(HiCacheController, name, f"sglang.{name}")
    except ImportError:
        pass


# -- reading (the worker and the main process) ---------------------------------------------


def read(folder: str | Path) -> list[dict[str, Any]]:
    """Every event line of every trace file in ``folder`` (``b`` lines included)."""
    out: list[dict[str, Any]] = []
    for path in sorted(Path(folder).glob("trace-*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # a line being written
    return out


def in_flight(events: list[dict[str, Any]]) -> int:
    """Hook calls started and not yet ended."""
    started = sum(1 for e in events if "b" in e)
    ended = sum(1 for e in events if "n" in e and e.get("kind") != "sgl")
    return started - ended


def stored_pages(events: list[dict[str, Any]], since: float) -> tuple[int, float]:
    """Pages written into a storage backend by calls that started at ``since`` or later, and
    when the last of them ended (``nan`` if none)."""
    pages, last = 0, float("nan")
    for e in events:
        short = str(e.get("n", "")).rsplit(".", 1)[-1]
        if e.get("kind") != "sgl" and short in _STORE_HOOKS and e["t0"] >= since:
            pages += int(e.get("pages") or 0)
            last = e["t1"] if last != last else max(last, e["t1"])
    return pages, last


def last_end(events: list[dict[str, Any]], since: float, names: Iterable[str]) -> float:
    """When the last event named one of ``names`` (full or short name) that started at
    ``since`` or later ended (``nan`` if none)."""
    wanted = set(names)
    ends = [
        e["t1"]
        for e in events
        if "n" in e
        and e["t0"] >= since
        and (e["n"] in wanted or str(e["n"]).rsplit(".", 1)[-1] in wanted)
    ]
    return max(ends) if ends else float("nan")


def summary(events: list[dict[str, Any]], t0: float, t1: float) -> dict[str, Any]:
    """Events that started in ``[t0, t1)``: per name ``[calls, pages, seconds]`` and the inner
    steps ``[seconds, calls]``, lmcache's hooks and SGLang's steps apart, and when the first
    started and the last ended."""
    hooks: dict[str, list[float]] = {}
    inner: dict[str, list[float]] = {}
    sgl: dict[str, list[float]] = {}
    first, last = float("nan"), float("nan")
    for e in events:
        if "n" not in e or not t0 <= e["t0"] < t1:
            continue
        table = sgl if e.get("kind") == "sgl" else hooks
        rec = table.setdefault(e["n"], [0, 0, 0.0])
        rec[0] += 1
        rec[1] += int(e.get("pages") or 0)
        rec[2] += e["t1"] - e["t0"]
        for name, (sec, calls) in e.get("sub", {}).items():
            sub = inner.setdefault(name, [0.0, 0])
            sub[0] += sec
            sub[1] += calls
        if table is hooks:
            first = e["t0"] if first != first else min(first, e["t0"])
            last = e["t1"] if last != last else max(last, e["t1"])
    return {"hooks": hooks, "inner": inner, "sglang": sgl, "first": first, "last": last}
