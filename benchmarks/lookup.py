# SPDX-License-Identifier: Apache-2.0
"""Latency of ``LMCacheEngine.lookup`` on a fully cached long prompt, next to its target.

Builds a real :class:`~lmcache.cache_engine.LMCacheEngine` with its CPU tier (no GPU: the paged
CPU test connector of :mod:`lmcache.testing` stores the prompt once), then times ``repeats``
lookups of the whole prompt after a warm-up, ``lookup_and_lease`` (what a vLLM worker runs: it
also verifies and leases each chunk; tiny chunks here) and the chunk-key hashing alone
(:func:`lmcache.keys.chunk_keys`). The token ids are given as a numpy ``int64`` array (as a
worker holds them), a torch ``int64`` tensor and a Python list (what vLLM's scheduler has: a
list must be converted once, and that conversion alone, ``array('I', ids)``, is timed too as
the floor of any list input).

With lmcache-vllm installed it also times the path vLLM's scheduler takes
(:func:`measure_scheduler_lookup`): ``SchedulerSide.get_num_new_matched_tokens`` of a request
whose 32k-token prompt (a Python list, as vLLM has it) a real ``WorkerSide`` stored, driven as
vLLM drives both without vLLM (``connector_vllm_config``, KV caches in vLLM's CPU layout,
``lmcache.checksum`` false: the lookup runs on the scheduler's thread, and neither the tier nor
the worker's lookup-time copy and check of the hit touch the chunks' bytes). Everything the
call costs is in: the request's key material, the query, the worker's lookup (hashing the
token ids, the lease of each hit chunk) and the answer. Four rows:

- ``scheduler, in process``: vLLM with one worker (its engine-core process holds the scheduler
  and the worker: the client calls the worker's lookup server directly);
- ``scheduler, socket``: worker ranks in other processes (tensor parallel): the same lookup over
  the rank's Unix socket to the worker's lookup server (here a thread of this process);
- each for a ``new request`` (a fresh request id per call: its first lookup; its lease is
  released after, untimed) and a ``waiting request`` (the same request asked again, as vLLM
  asks at every step until it schedules the request).

It prints p50 / p99 of each next to the target (``lookup`` p99 < 0.2 ms for 32k tokens, issue
27) and ``missed`` where the p99 is above it; without lmcache-vllm the scheduler rows print
``skipped (lmcache-vllm not installed)``. Run ``python benchmarks/lookup.py [--tokens N]
[--repeats N]`` (a few seconds). :func:`measure_lookup` returns the figures for another
benchmark to use.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import time
from array import array
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from lmcache.cache_engine import LMCacheEngine
from lmcache.config import LMCacheConfig
from lmcache.gpu_connector.interface import EngineInfo, TransferSpec
from lmcache.keys import chunk_keys
from lmcache.metadata import LMCacheMetadata
from lmcache.testing import PagedCPUConnector

TARGET_P99_MS = 0.2
"""Issue 27's target: ``lookup`` of a fully cached 32k-token prompt, p99."""

CHUNK_SIZE = 256
VOCAB = 128_000
LAYERS, KV_HEADS, HEAD = 1, 1, 4  # tiny chunks: the lookup never reads KV bytes
WARMUP = 50


def _percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"p50_ms": pick(0.50) * 1e3, "p99_ms": pick(0.99) * 1e3}


def _time(fn: Callable[[], object], repeats: int) -> dict[str, float]:
    for _ in range(WARMUP):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return _percentiles(samples)


def _engine(num_tokens: int) -> LMCacheEngine:
    metadata = LMCacheMetadata(
        "benchmark/lookup", 1, 0, 0, 1, torch.bfloat16, LAYERS, KV_HEADS, HEAD, HEAD,
        chunk_size=CHUNK_SIZE,
    )  # fmt: skip
    config = LMCacheConfig(chunk_size=CHUNK_SIZE, max_local_cpu_size=1.0)
    caches = [
        torch.zeros(num_tokens, 1, metadata.kv_width, dtype=torch.bfloat16) for _ in range(LAYERS)
    ]
    connector = PagedCPUConnector(
        config, metadata, EngineInfo("mock", "cpu", caches, extra={"page_size": 1})
    )
    return LMCacheEngine(config, metadata, connector, lower_tiers=())


def measure_lookup(num_tokens: int = 32768, repeats: int = 200) -> dict[str, Any]:
    """Time lookups of a fully cached ``num_tokens`` prompt (see the module docstring).

    Returns:
        ``{"p50_ms", "p99_ms", "num_tokens", "repeats", "target_p99_ms", "lookup": {input:
        {"p50_ms", "p99_ms"}},
        "lookup_and_lease": {input: {...}}, "hashing": {input: {...}}, "list_conversion":
        {...}, "met": bool}`` with inputs
        ``"numpy"``, ``"torch"`` and ``"list"``. The top-level ``p50_ms`` / ``p99_ms`` and
        ``met`` (p99 below the target) are the lookup of numpy ids (token ids already in an
        array, as a worker decodes them from a lookup socket); a list pays its conversion on
        top (``list_conversion``).

    Raises:
        RuntimeError: the stored prompt is not found whole (the figures would time a miss).
    """
    rng = random.Random(0)
    ids = [rng.randrange(VOCAB) for _ in range(num_tokens)]
    inputs: dict[str, Any] = {
        "numpy": np.asarray(ids, dtype=np.int64),
        "torch": torch.tensor(ids, dtype=torch.int64),
        "list": ids,
    }
    engine = _engine(num_tokens)
    try:
        engine.store(inputs["torch"], None, TransferSpec(torch.arange(num_tokens)))
        for name, tokens in inputs.items():
            found = engine.lookup(tokens)
            if found != num_tokens:
                raise RuntimeError(f"lookup({name}) found {found} of {num_tokens} stored tokens")
        fingerprint = engine.metadata.fingerprint()
        salt = engine.config.cache_salt + "\0"
        lookup = {
            name: _time(lambda t=tokens: engine.lookup(t), repeats)
            for name, tokens in inputs.items()
        }
        leased = {
            name: _time(lambda t=tokens: engine.lookup_and_lease(t).release(), repeats)
            for name, tokens in inputs.items()
        }
        hashing = {
            name: _time(lambda t=tokens: chunk_keys(t, fingerprint, CHUNK_SIZE, salt=salt), repeats)
            for name, tokens in inputs.items()
        }
        conversion = _time(lambda: array("I", ids), repeats)
    finally:
        engine.close()
    return {
        "p50_ms": lookup["numpy"]["p50_ms"],
        "p99_ms": lookup["numpy"]["p99_ms"],
        "num_tokens": num_tokens,
        "repeats": repeats,
        "target_p99_ms": TARGET_P99_MS,
        "lookup": lookup,
        "lookup_and_lease": leased,
        "hashing": hashing,
        "list_conversion": conversion,
        "met": lookup["numpy"]["p99_ms"] < TARGET_P99_MS,
    }


def measure_scheduler_lookup(
    num_tokens: int = 32768, repeats: int = 200
) -> dict[str, dict[str, float]] | None:
    """Time vLLM's scheduler-side lookup of a fully cached ``num_tokens`` prompt (see the
    module docstring); ``None`` when lmcache-vllm is not installed.

    Returns:
        ``{row: {"p50_ms", "p99_ms"}}`` for the rows ``"in process, new request"``,
        ``"in process, waiting request"``, ``"socket, new request"`` and
        ``"socket, waiting request"``.

    Raises:
        RuntimeError: the stored prompt is not found whole (the figures would time a miss).
    """
    try:
        from lmcache.tiers import reset_process_cpu_tiers
        from lmcache_vllm.connector_metadata import LMCacheConnectorMetadata, ReqMeta, SaveSpec
        from lmcache_vllm.lookup_sockets import engine_key
        from lmcache_vllm.scheduler.lookup_client import LookupClient
        from lmcache_vllm.scheduler.side import SchedulerSide
        from lmcache_vllm.testing import connector_vllm_config
        from lmcache_vllm.vllm_v1_adapter import load_lmcache_config
        from lmcache_vllm.worker.side import WorkerSide
    except ImportError:
        return None
    from types import SimpleNamespace

    block = 16
    vc = connector_vllm_config(
        engine_id=f"bench-lookup-{os.getpid()}-{time.time_ns()}",
        block_size=block,
        head_size=HEAD,
        extra_config={
            "lmcache.chunk_size": CHUNK_SIZE,
            "lmcache.max_local_cpu_size": 0.05,
            "lmcache.checksum": False,
        },
    )
    reset_process_cpu_tiers()
    config = load_lmcache_config(vc)
    meta = LMCacheConnectorMetadata()
    worker = WorkerSide(vc, config, engine_key(vc), 1, 0, lambda: meta)
    scheduler = None
    try:
        num_blocks = -(-num_tokens // block) + 1
        caches = {
            f"model.layers.{i}.self_attn.attn": torch.zeros(num_blocks, KV_HEADS, block, 2 * HEAD)
            for i in range(LAYERS)
        }
        worker.register_kv_caches(caches)
        rng = random.Random(1)
        ids = [rng.randrange(VOCAB) for _ in range(num_tokens)]
        # one vLLM step that computes (and saves) the whole prompt
        save = SaveSpec(skip=0, end=num_tokens)
        meta = LMCacheConnectorMetadata(
            requests=[ReqMeta("writer", ids, list(range(1, num_blocks)), save=save)]
        )
        worker.bind(meta)
        worker.start_load_kv()
        for name in caches:
            worker.wait_for_layer_load(name)
            worker.save_kv_layer(name)
        worker.wait_for_save()
        engine = worker.lmcache_engine
        assert engine is not None
        stop = time.monotonic() + 60
        while engine.lookup(ids) < num_tokens and time.monotonic() < stop:
            time.sleep(0.01)  # the save is published off the step
        scheduler = SchedulerSide(vc, config, world_size=1, local_world_size=1)
        want = (num_tokens - 1) // block * block  # vLLM computes the prompt's last block

        def request(rid: str) -> Any:
            return SimpleNamespace(
                request_id=rid, prompt_token_ids=ids, num_tokens=num_tokens, cache_salt=None,
                lora_request=None, mm_features=[], prompt_embeds=None,
                all_token_ids=ids,
            )  # fmt: skip

        def ask(req: Any) -> None:
            assert scheduler is not None
            got = scheduler.get_num_new_matched_tokens(req, 0)
            if got != want:
                raise RuntimeError(f"the scheduler's lookup found {got} of {want} tokens")

        def new_request_rows(prefix: str) -> dict[str, float]:
            samples = []
            for i in range(WARMUP + repeats):
                req = request(f"{prefix}-{i}")  # request ids are never reused
                start = time.perf_counter()
                ask(req)
                samples.append(time.perf_counter() - start)
                assert scheduler is not None
                scheduler.request_finished(req, [])  # it ends, untimed: its lease goes
                worker.get_finished({req.request_id})
            return _percentiles(samples[WARMUP:])

        rows: dict[str, dict[str, float]] = {}
        rows["in process, new request"] = new_request_rows("direct")
        waiting = request("waiting")
        rows["in process, waiting request"] = _time(lambda: ask(waiting), repeats)
        # the ranks in other processes: a client that goes through the sockets only
        direct = scheduler.lookups.client
        if direct is not None:
            direct.close()
        scheduler.lookups.client = LookupClient(scheduler.engine_key, 1, in_process=False)
        rows["socket, new request"] = new_request_rows("socket")
        waiting = request("waiting-socket")
        rows["socket, waiting request"] = _time(lambda: ask(waiting), repeats)
        return rows
    finally:
        if scheduler is not None:
            scheduler.close()
        worker.shutdown()
        reset_process_cpu_tiers()


def _line(label: str, fig: dict[str, float], target: float | None) -> str:
    text = f"  {label:<36} p50 {fig['p50_ms']:7.3f} ms   p99 {fig['p99_ms']:7.3f} ms"
    if target is not None:
        verdict = "met" if fig["p99_ms"] < target else "missed"
        text += f"   target p99 < {target:g} ms: {verdict}"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=32768, help="prompt length (32768)")
    parser.add_argument("--repeats", type=int, default=200, help="timed calls per figure (200)")
    args = parser.parse_args(argv)
    if args.repeats < 100:
        parser.error("--repeats must be >= 100 for a p99")
    print(
        f"lookup of a fully cached {args.tokens}-token prompt, chunk_size {CHUNK_SIZE}, CPU tier; "
        f"{args.repeats} timed calls after {WARMUP} warm-up ({platform.processor() or 'cpu'}, "
        f"{os.cpu_count()} cores, torch {torch.__version__})"
    )
    fig = measure_lookup(args.tokens, args.repeats)
    target = TARGET_P99_MS if args.tokens == 32768 else None
    for name in ("numpy", "torch", "list"):
        print(_line(f"lookup ({name} ids)", fig["lookup"][name], target))
    for name in ("numpy", "list"):
        print(_line(f"lookup_and_lease ({name} ids)", fig["lookup_and_lease"][name], None))
    for name in ("numpy", "torch", "list"):
        print(_line(f"hashing alone ({name} ids)", fig["hashing"][name], None))
    print(_line("list -> uint32 (floor)", fig["list_conversion"], None))
    rows = measure_scheduler_lookup(args.tokens, args.repeats)
    if rows is None:
        print(f"  {'scheduler (vLLM path)':<36} skipped (lmcache-vllm not installed)")
        return 0
    for name, row in rows.items():
        print(_line(f"scheduler, {name}", row, target))
    return 0


if __name__ == "__main__":
    sys.exit(main())
