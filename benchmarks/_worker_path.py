# SPDX-License-Identifier: Apache-2.0
"""lmcache's vLLM worker driven as vLLM drives it, without vLLM: what ``gpu_transfer.py`` times.

:class:`Rig` holds the scheduler side and the worker side of one engine
(:class:`~lmcache_vllm.scheduler.side.SchedulerSide`,
:class:`~lmcache_vllm.worker.side.WorkerSide`) over one paged KV cache in vLLM's CUDA layout.
It uses Llama-8B KV geometry (8 KV heads of 128, bf16), 16-token pages in shuffled order and
256-token chunks, with the host pool pinned before anything is timed.
A step is the hooks vLLM calls, in vLLM's order (:meth:`Rig.step`).
A load starts at the scheduler's lookup, where the worker leases the hit and, on CUDA, starts
copying it to the device.
The lookup is synchronous: the stand-in config names no device, so the scheduler does not move
it to a thread pool as it does on CUDA with checksums.
On the CPU (the ``--smoke`` runs) the worker has no streams: loads and the save's copy are
synchronous, and the pages are in vLLM's CPU layout (each page head-major, K transposed).

:func:`ceilings` times pinned copies of given bytes, the ceiling each transfer is printed beside.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch
from _common import event_ms, median

from lmcache.cache_engine import LMCacheEngine
from lmcache.tiers import reset_process_cpu_tiers
from lmcache_vllm.connector_metadata import LMCacheConnectorMetadata, LoadSpec, ReqMeta, SaveSpec
from lmcache_vllm.lookup_sockets import engine_key
from lmcache_vllm.scheduler.side import SchedulerSide
from lmcache_vllm.testing import connector_vllm_config
from lmcache_vllm.vllm_v1_adapter import load_lmcache_config
from lmcache_vllm.worker.side import WorkerSide

HEADS, HEAD, PAGE, CHUNK = 8, 128, 16, 256
DTYPE = torch.bfloat16


@dataclasses.dataclass
class Request:
    """A prompt and the pages vLLM gave it (one page per 16 tokens)."""

    tokens: list[int]
    blocks: list[int]
    nbytes: int  # its KV bytes


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 100_000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def stream_sync(device: torch.device) -> None:
    """Wait for the current stream only (another thread's GEMMs are not waited for)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class Rig:
    """The scheduler and worker sides of one engine over a paged cache (see the module docstring).

    Args:
        device: Where the KV cache lives.
        layers: Transformer layers.
        tokens: Tokens the cache must hold (pages for them, and 8 more).
        gib: The host pool (``lmcache.max_local_cpu_size``).
        checksum: ``lmcache.checksum``; ``None`` leaves the default.
    """

    def __init__(
        self, device: torch.device, layers: int, tokens: int, gib: float, checksum: bool | None
    ) -> None:
        reset_process_cpu_tiers()  # the host tier is process-wide: start empty
        extra: dict[str, Any] = {"lmcache.chunk_size": CHUNK, "lmcache.max_local_cpu_size": gib}
        if checksum is not None:
            extra["lmcache.checksum"] = checksum
        vc = connector_vllm_config(
            engine_id=f"gpu-transfer-{time.time_ns()}",
            block_size=PAGE,
            head_size=HEAD,
            model="bench/llama-8b",
            dtype="bfloat16",
            extra_config=extra,
        )
        config = load_lmcache_config(vc)
        self.device, self.num_layers = device, layers
        self.meta = LMCacheConnectorMetadata()
        self.worker = WorkerSide(vc, config, engine_key(vc), 1, 0, lambda: self.meta)
        blocks = tokens // PAGE + 8
        # one buffer, per layer a [blocks, heads, 16, 256] view: vLLM's FlashAttention layout
        # (token-major pages) on CUDA, its CPU attention's (head-major pages) on the CPU
        cuda = device.type == "cuda"
        shape = (blocks, PAGE, HEADS) if cuda else (blocks, HEADS, PAGE)
        self.raw = torch.randn(layers, *shape, 2 * HEAD, device=device, dtype=DTYPE)
        self.caches = {
            f"model.layers.{i}.self_attn.attn": self.raw[i].permute(0, 2, 1, 3)
            if cuda
            else self.raw[i]
            for i in range(layers)
        }
        self.worker.register_kv_caches(self.caches)
        self.scheduler = SchedulerSide(vc, config, world_size=1, local_world_size=1)
        self._free = (torch.randperm(blocks - 1) + 1).tolist()  # shuffled; page 0 unused
        self._ids = itertools.count()
        self._open: list[tuple[str, Any]] = []  # requests looked up and not yet finished
        if not self.engine.pool.wait_prepinned(timeout=300):
            raise SystemExit("the host pool was not pinned within 300 s")

    @property
    def engine(self) -> LMCacheEngine:
        engine = self.worker.lmcache_engine
        assert engine is not None  # registered in __init__
        return engine

    @property
    def token_bytes(self) -> int:
        return self.num_layers * 2 * HEADS * HEAD * DTYPE.itemsize

    def request(self, n: int, seed: int) -> Request:
        """A request of ``n`` tokens on pages of its own."""
        count = -(-n // PAGE)
        if count > len(self._free):
            raise ValueError(f"the cache has {len(self._free)} free pages; {count} needed")
        pages, self._free = self._free[:count], self._free[count:]
        return Request(tokens(n, seed), pages, n * self.token_bytes)

    def pages(self, req: Request) -> torch.Tensor:
        """The request's pages, every layer (a view)."""
        return torch.stack([c[req.blocks] for c in self.caches.values()])

    def step(self, *reqs: ReqMeta) -> None:
        """One step: the worker hooks vLLM calls, in its order (the forward's layers between)."""
        self.meta = LMCacheConnectorMetadata(requests=list(reqs))
        self.worker.handle_preemptions(self.meta)
        self.worker.bind(self.meta)  # bind_connector_metadata
        self.worker.start_load_kv()
        for name in self.caches:
            self.worker.wait_for_layer_load(name)
            self.worker.save_kv_layer(name)
        self.worker.wait_for_save()
        self.worker.get_finished(set())
        errors = self.worker.get_block_ids_with_load_errors()
        if errors:
            raise RuntimeError(f"the worker reported {len(errors)} blocks as load errors")

    def save(self, req: Request) -> None:
        """A step that computed ``req``'s prompt: its save is queued, not waited for."""
        n = len(req.tokens)
        self.step(ReqMeta(f"s{next(self._ids)}", req.tokens, req.blocks, save=SaveSpec(0, n)))

    def saved(self) -> None:
        """Wait until every queued save is copied out of the pages and its chunks published."""
        if not self.worker._saves.wait(timeout=300):  # the worker has no public wait
            raise RuntimeError("the worker's saves did not finish within 300 s")

    def store(self, req: Request) -> None:
        self.save(req)
        self.saved()

    def load(self, req: Request) -> bool:
        """A new prompt that starts with ``req``'s tokens (one token more: vLLM computes the
        last one), from the scheduler's lookup until the hit is in the pages; returns whether
        the lookup copied the hit to the device (CUDA, within the prefetch budget)."""
        n = len(req.tokens)
        rid = f"l{next(self._ids)}"
        prompt = [*req.tokens, 1]
        request = SimpleNamespace(
            request_id=rid,
            prompt_token_ids=prompt,
            all_token_ids=prompt,
            num_tokens=len(prompt),
            cache_salt=None,
            lora_request=None,
            mm_features=[],
            prompt_embeds=None,
        )
        self._open.append((rid, request))
        before = self.worker.prefetcher.in_flight_bytes
        need = self.scheduler.get_num_new_matched_tokens(request, 0)
        prefetched = self.worker.prefetcher.in_flight_bytes > before
        if need != n:
            raise RuntimeError(f"the lookup of {n} cached tokens promised {need}")
        self.scheduler.update_state_after_alloc(request, need)
        self.step(ReqMeta(rid, req.tokens, req.blocks, load=LoadSpec(0, n, n)))
        stream_sync(self.device)  # the forward (vLLM's stream) would read the pages now
        return prefetched

    def forget(self) -> None:
        """End the requests loaded so far, as vLLM does when they finish (untimed)."""
        for _, request in self._open:
            self.scheduler.request_finished(request, [])
        self.worker.get_finished({rid for rid, _ in self._open})
        self._open = []

    def clear(self) -> None:
        """Empty the cache (after the queued saves), so that the next store stores again."""
        self.forget()
        self.saved()
        self.engine.clear()

    def bit_exact(self, req: Request) -> bool:
        """Store ``req``, poison its pages, load it: are its bits back?"""
        self.clear()
        self.store(req)
        want = self.pages(req).clone()
        for c in self.caches.values():
            c[req.blocks] = float("nan")
        self.load(req)
        got = self.pages(req)
        self.forget()
        return torch.equal(got.view(torch.int16), want.view(torch.int16))

    def close(self) -> None:
        self.forget()
        self.scheduler.close()
        self.worker.shutdown()
        reset_process_cpu_tiers()


def streams(device: torch.device, count: int) -> list[Any]:
    """``count`` new CUDA streams; ``None`` each on the CPU (work there runs in order)."""
    if device.type != "cuda":
        return [None] * count
    return [torch.cuda.Stream(device) for _ in range(count)]  # type: ignore[no-untyped-call]


@contextlib.contextmanager
def on(stream: Any) -> Iterator[None]:
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        yield


def ceilings(device: torch.device, nbytes: int, reps: int) -> dict[str, float]:
    """Pinned copies of ``nbytes``: device ms per copy each way, and both ways at once."""
    pin = device.type == "cuda"
    host = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
    dev = [torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device) for _ in range(2)]
    host[1].copy_(dev[1])
    inner = max(1, (256 << 20) // nbytes)  # >= 256 MiB between two events
    d2h = median(event_ms(device, lambda: host[0].copy_(dev[0], non_blocking=True), reps, 3, inner))
    h2d = median(event_ms(device, lambda: dev[1].copy_(host[1], non_blocking=True), reps, 3, inner))
    s_out, s_in = streams(device, 2)

    def both() -> None:  # each copy on its own stream, both inside the current stream's events
        for stream, dst, src in ((s_out, host[0], dev[0]), (s_in, dev[1], host[1])):
            if stream is not None:
                stream.wait_stream(torch.cuda.current_stream(device))
            with on(stream):
                dst.copy_(src, non_blocking=True)
        for stream in (s_out, s_in):
            if stream is not None:
                torch.cuda.current_stream(device).wait_stream(stream)

    duplex = median(event_ms(device, both, reps, 3, inner))
    return {"d2h": d2h, "h2d": h2d, "duplex": duplex}
