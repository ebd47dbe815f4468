# SPDX-License-Identifier: Apache-2.0
"""Stress of the worker path: no DMA touches host memory handed back, and no loaded byte
differs from what was stored.

One scheduler side and one worker side of the connector, driven as vLLM drives them. A scheduler
thread (lookups, block allocation, ``build_connector_meta``, ``request_finished``) schedules a
step while a worker thread runs the one before (vLLM's asynchronous scheduling). The worker runs
vLLM's hooks in vLLM's order. Client threads send requests and abort a quarter of them at random
moments. The connector's own threads run alongside: the lookup pool and server (with the hit's
prefetch and check), and the save queue's copy and commit threads. Prompts share prefixes, so
requests hit each other's chunks. Prefill is chunked, so saves go in pieces. Running requests
are preempted (blocks freed, scheduled again later). Freed blocks are reused first. The CPU tier
is small, so stores evict. Checksums are on.

The forward writes each token's KV as a function of its id, its position and its prefix. After
each step, every token a load wrote (its pages poisoned before the load) must hold exactly that.
Every byte the host pool takes back is filled with a canary and watched
(:mod:`lmcache.testing.canaries`). On the CPU the device is the recording stand-in of a CUDA
device, which knows which copies the host has waited for: a copy that touches memory handed
back, or memory handed back or out under a copy in flight, fails the test, and so does a loaded
hit's copy still in flight after its step. On a GPU a late DMA overwrites the canary. At the end:
no violation, no load error, no checksum failure, no error logged or raised on any thread, and
no lease left (the pool is empty once the tier is cleared). The GPU variant (``nox -s gpu -- -k
worker_stress``) runs more threads and requests, with prompts of up to 16k tokens.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import random
import threading
import time
import traceback
from collections import deque
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lmcache.devices import get_backend, register_backend
from lmcache.devices import registry as device_registry
from lmcache.testing.canaries import watch_host_memory
from lmcache.testing.recording_backend import RecordingBackend
from lmcache.tiers import reset_process_cpu_tiers
from lmcache_vllm.connector_metadata import LMCacheConnectorMetadata
from lmcache_vllm.lookup_sockets import engine_key
from lmcache_vllm.scheduler.side import SchedulerSide
from lmcache_vllm.testing import connector_vllm_config, slow_save_copies
from lmcache_vllm.vllm_v1_adapter import load_lmcache_config
from lmcache_vllm.worker import kv_registration
from lmcache_vllm.worker.side import WorkerSide

POISON = -1000.0  # never a KV value (those are integers in [-64, 63])
VOCAB = 50_000


@dataclasses.dataclass(frozen=True)
class Size:
    """One run's shape (``prefix_max``, ``suffix_max``: prompt parts in tokens; ``step_tokens``:
    chunked prefill's budget per step; ``tier_chunks``: the CPU tier's budget in chunks)."""

    clients: int  # threads sending requests, each with up to two in flight
    requests: int  # per client
    layers: int
    heads: int
    head: int
    chunk: int
    prefixes: int  # shared prompt heads
    prefix_max: int
    suffix_max: int
    step_tokens: int
    tier_chunks: int
    page: int = 16


CPU = Size(6, 80, 2, 2, 32, 64, 8, 768, 320, 384, 48)
GPU = Size(8, 12, 8, 8, 128, 256, 6, 12288, 4096, 8192, 192)


@dataclasses.dataclass(eq=False)
class Req:
    """A request as vLLM's scheduler keeps it (``request``: what the connector reads)."""

    rid: str
    prompt: list[int]
    max_out: int
    request: SimpleNamespace
    blocks: list[int] = dataclasses.field(default_factory=list)
    computed: int = 0
    seen: bool = False  # scheduled before: it comes back as a resumed request
    last_step: int = -1  # the step that ends it (its last token sampled)
    state: str = "waiting"  # running, finishing, ended
    done: threading.Event = dataclasses.field(default_factory=threading.Event)


@dataclasses.dataclass(eq=False)
class _Step:
    """One step: vLLM's ``SchedulerOutput`` and the forward's ``inputs`` (per request: id,
    tokens, blocks, and the tokens computed ``[start, end)``)."""

    step: int
    budget: int
    finished: set[str] = dataclasses.field(default_factory=set)
    preempted: set[str] = dataclasses.field(default_factory=set)
    new: list[Any] = dataclasses.field(default_factory=list)
    cached: list[tuple[str, Any, int]] = dataclasses.field(default_factory=list)
    resumed: set[str] = dataclasses.field(default_factory=set)
    scheduled: dict[str, int] = dataclasses.field(default_factory=dict)
    inputs: list[Any] = dataclasses.field(default_factory=list)

    def output(self) -> SimpleNamespace:
        cached = SimpleNamespace(
            req_ids=[c[0] for c in self.cached],
            new_block_ids=[c[1] for c in self.cached],
            num_computed_tokens=[c[2] for c in self.cached],
            resumed_req_ids=self.resumed,
        )
        return SimpleNamespace(
            finished_req_ids=self.finished,
            preempted_req_ids=self.preempted,
            num_scheduled_tokens=self.scheduled,
            scheduled_new_reqs=self.new,
            scheduled_cached_reqs=cached,
        )


class Stress:
    """The scheduler, worker and client threads over one connector pair (module docstring)."""

    def __init__(self, size: Size, device: torch.device, layerwise: bool, seed: int) -> None:
        self.size, self.device, self.rng = size, device, random.Random(seed)
        reset_process_cpu_tiers()
        chunk_bytes = size.layers * size.chunk * size.heads * 2 * size.head * 2
        vc = connector_vllm_config(
            engine_id=f"stress-{time.time_ns()}",
            block_size=size.page,
            head_size=size.head,
            dtype="bfloat16",
            extra_config={
                "lmcache.chunk_size": size.chunk,
                "lmcache.max_local_cpu_size": size.tier_chunks * chunk_bytes / 1024**3,
                "lmcache.checksum": True,
                "lmcache.use_layerwise": layerwise,
                # partial last chunks: evicted buffers of other shapes go back to the pool
                "lmcache.save_unfull_chunk": not layerwise,
            },
        )
        vc.device_config = SimpleNamespace(device_type="cuda")  # lookups off-thread, as on CUDA
        config = load_lmcache_config(vc)
        self.meta: object = LMCacheConnectorMetadata()
        self.worker = WorkerSide(vc, config, engine_key(vc), 1, 0, lambda: self.meta)
        self.num_blocks = size.clients * 2 * -(-(size.prefix_max + size.suffix_max) // size.page)
        shape = (size.layers, self.num_blocks, size.page, size.heads, 2 * size.head)
        raw = torch.zeros(shape, dtype=torch.bfloat16, device=device)  # vLLM's LBNHC
        self.caches = {
            f"model.layers.{i}.attn": raw[i].permute(0, 2, 1, 3) for i in range(len(raw))
        }
        self.worker.register_kv_caches(self.caches)
        self.scheduler = SchedulerSide(vc, config, world_size=1, local_world_size=1)
        self.backend = get_backend(device)
        self.rec = self.backend if isinstance(self.backend, RecordingBackend) else None
        assert self.worker.lmcache_engine is not None
        self.engine = self.worker.lmcache_engine
        g = torch.Generator().manual_seed(seed)
        self.mult = torch.randint(
            1, 1 << 30, (size.layers, raw.shape[-1] * size.heads), generator=g
        )
        self.mult = (self.mult * 2 + 1).to(device)  # odd: every bit of a token's hash matters
        lengths = [self.rng.randrange(size.chunk, size.prefix_max) for _ in range(size.prefixes)]
        self.prefixes = [[self.rng.randrange(1, VOCAB) for _ in range(n)] for n in lengths]
        self.errors: list[str] = []
        self.counts = {"loads": 0, "loaded_tokens": 0, "aborts": 0, "preempted": 0, "steps": 0}
        self.inbox: queue.Queue[Req] = queue.Queue()
        self.aborts: queue.Queue[Req] = queue.Queue()
        self.steps: queue.Queue[Any] = queue.Queue(maxsize=1)
        self.executed: queue.Queue[int] = queue.Queue()
        self.done_step = -1  # the last step the worker ran, as the scheduler knows it
        self.load_errors: set[int] = set()  # blocks of this step's loads reported as errors
        self.stop = threading.Event()
        self.free = list(range(1, self.num_blocks))  # page 0 unused
        self.rng.shuffle(self.free)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self._lock = threading.Lock()
        self.lookups: dict[str, int] = {}  # request -> lookups so far
        self.latest: dict[str, int] = {}  # request -> the lookup whose hit the worker holds
        self.consumed: set[tuple[str, str, int | None]] = set()  # lookups whose hit was loaded
        if self.rec is not None:
            self._label_lookups(self.rec)

    # -- the model: KV as a function of token id, position and prefix -------------------------

    def kv(self, tokens: list[int], start: int, end: int) -> torch.Tensor:
        """``[layers, end - start, heads, 2 * head]`` KV of ``tokens[start:end]``."""
        t = torch.tensor(tokens[:end], dtype=torch.int64, device=self.device)
        pos = torch.arange(end, dtype=torch.int64, device=self.device)
        prefix = torch.cumsum(t * (pos * 7919 % 65521 + 1), 0) % 1_000_003
        h = ((t * 40503 + pos * 2654435 + prefix * 7919) % 2_147_483_647)[start:, None]
        layers = [((((h * m) >> 20) & 0x7F) - 64).to(torch.bfloat16) for m in self.mult]
        return torch.stack(layers).view(len(layers), end - start, self.size.heads, -1)

    def _slots(self, blocks: list[int], start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(start, end)
        blk = torch.tensor(blocks, dtype=torch.int64)[pos // self.size.page]
        return blk.to(self.device), (pos % self.size.page).to(self.device)

    # -- clients -------------------------------------------------------------------------------

    def client(self, index: int) -> None:
        rng, live = random.Random(1000 + index), deque[Req]()
        for n in range(self.size.requests):
            head = rng.choice(self.prefixes)
            head = head[: rng.randrange(1, len(head) + 1)] if rng.random() < 0.3 else head
            tail = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, self.size.suffix_max))]
            prompt, rid = head + tail, f"c{index}-{n}"
            request = SimpleNamespace(
                request_id=rid, prompt_token_ids=prompt, all_token_ids=list(prompt),
                num_tokens=len(prompt), num_computed_tokens=0, num_output_placeholders=0,
                cache_salt=None, lora_request=None, mm_features=[], prompt_embeds=None,
            )  # fmt: skip
            req = Req(rid, prompt, rng.randrange(1, 4), request)
            self.inbox.put(req)
            live.append(req)
            if rng.random() < 0.25:  # aborted at some point of its life
                time.sleep(rng.uniform(0.0, 0.05))
                self.aborts.put(req)
            while len(live) >= 2 or (n == self.size.requests - 1 and live):
                oldest = live.popleft()
                while not oldest.done.wait(0.2):
                    if self.stop.is_set():
                        return

    # -- the scheduler thread ------------------------------------------------------------------

    def scheduler_loop(self, clients: list[threading.Thread]) -> None:
        step = 0
        while not self.stop.is_set():
            while not self.inbox.empty():
                self.waiting.append(self.inbox.get())
            # vLLM's asynchronous scheduling: step N + 1 is scheduled while step N runs
            while self.done_step < step - 2 and not self.stop.is_set():
                with contextlib.suppress(queue.Empty):
                    self.done_step = self.executed.get(timeout=0.2)
            while not self.executed.empty():
                self.done_step = self.executed.get()
            plan = _Step(step, self.size.step_tokens)
            self._end_requests(plan)
            self._preempt(plan)
            for r in self.running:
                if r.state == "running" and plan.budget > 0:
                    plan.cached.append((r.rid, None, r.computed))
                    self._run(plan, r, r.computed)
            if not plan.preempted:  # as vLLM: no waiting request joins a step that preempts
                self._admit(plan)
            meta = self.scheduler.build_connector_meta(plan.output())
            if plan.inputs or plan.finished or plan.preempted or meta.finished:
                self._put((step, meta, plan.inputs, plan.finished))
                step += 1
            elif self.waiting or self.running or any(c.is_alive() for c in clients):
                time.sleep(0.002)
            else:
                break
        self._put(None)

    def _end(self, plan: _Step, r: Req) -> None:
        """vLLM ends ``r`` (finished or aborted): the connector hears, its blocks are free."""
        self.scheduler.request_finished(r.request, list(r.blocks))
        self.free[:0] = r.blocks  # reused first: a read of them that comes late shows
        r.blocks, r.state = [], "ended"
        plan.finished.add(r.rid)
        r.done.set()

    def _end_requests(self, plan: _Step) -> None:
        while not self.aborts.empty():
            r = self.aborts.get()
            while not self.inbox.empty():  # it came in before its abort
                self.waiting.append(self.inbox.get())
            if r.state in ("waiting", "running"):
                (self.waiting if r.state == "waiting" else self.running).remove(r)
                self.counts["aborts"] += 1
                self._end(plan, r)
        for r in self.running[:]:
            if r.state == "finishing" and r.last_step <= self.done_step:
                self.running.remove(r)
                self._end(plan, r)

    def _preempt(self, plan: _Step) -> None:
        """Now and then a running request loses its blocks and waits to be scheduled again."""
        live = [r for r in self.running if r.state == "running"]
        if not live or self.rng.random() >= 0.08:
            return
        r = self.rng.choice(live)
        self.running.remove(r)
        self.free[:0] = r.blocks
        r.blocks, r.computed, r.state = [], 0, "waiting"
        r.request.num_computed_tokens = 0
        self.waiting.appendleft(r)
        plan.preempted.add(r.rid)
        self.counts["preempted"] += 1

    def _admit(self, plan: _Step) -> None:
        """Waiting requests whose lookup is answered get blocks and their first tokens."""
        for r in list(self.waiting):
            if plan.budget <= 0:
                return
            hit = self.scheduler.get_num_new_matched_tokens(r.request, 0)
            if hit is None:
                continue  # its lookup is in flight: asked again next step
            need = -(-(len(r.prompt) + r.max_out) // self.size.page)
            if need > len(self.free):
                return
            r.blocks, self.free[:need] = self.free[:need], []
            self.scheduler.update_state_after_alloc(r.request, hit)
            self.waiting.remove(r)
            self.running.append(r)
            r.state = "running"
            if r.seen:
                plan.cached.append((r.rid, (list(r.blocks),), hit))
                plan.resumed.add(r.rid)
            else:
                new = {"req_id": r.rid, "prompt_token_ids": r.prompt}
                new |= {"block_ids": (list(r.blocks),), "num_computed_tokens": hit}
                plan.new.append(SimpleNamespace(**new))
            r.seen = True
            self._run(plan, r, hit)

    def _run(self, plan: _Step, r: Req, start: int) -> None:
        """Schedule ``r``'s next tokens from ``start``; sample one when they reach its end."""
        tokens = r.request.all_token_ids
        n = min(plan.budget, len(tokens) - start)
        plan.budget -= n
        plan.inputs.append((list(tokens), list(r.blocks), start, start + n))
        plan.scheduled[r.rid] = n
        r.computed = r.request.num_computed_tokens = start + n
        if r.computed < len(tokens):
            return
        if len(tokens) - len(r.prompt) + 1 >= r.max_out:  # its last token: it ends
            r.state, r.last_step = "finishing", plan.step
        else:
            tokens.append(sum(tokens[-3:]) % VOCAB)
            r.request.num_tokens += 1

    def _put(self, item: Any) -> None:
        while not self.stop.is_set():
            with contextlib.suppress(queue.Full):
                return self.steps.put(item, timeout=0.2)

    # -- the worker thread ---------------------------------------------------------------------

    def worker_loop(self) -> None:
        while not self.stop.is_set():
            try:
                item = self.steps.get(timeout=0.2)
            except queue.Empty:
                continue
            if item is None:
                return
            self.load_errors = set()
            with self.rec.labelled(("step", item[0])) if self.rec else contextlib.nullcontext():
                loads = self._step(*item)
            if self.backend.device_type == "cuda":  # read the pages after the forward
                self.backend.stream_synchronize(self.backend.current_stream(self.device))
            for r in loads:
                self._check_load(item[0], r)
            self.counts["steps"] += 1
            self.executed.put(item[0])

    def _step(self, step: int, meta: Any, inputs: list[Any], finished: set[str]) -> list[Any]:
        """One step of the worker, vLLM's hooks in vLLM's order; returns its loads."""
        w = self.worker
        self.meta = meta
        w.handle_preemptions(meta)
        w.bind(meta)
        loads = [r for r in meta.requests if r.load is not None]
        for r in loads:  # vLLM may rewrite freed blocks from here on: poison the loads'
            blk, off = self._slots(r.block_ids, r.load.vllm_cached, r.load.load_end)
            for cache in self.caches.values():
                cache[blk, :, off, :] = POISON
        with self._lock:  # the lookups whose hits these loads take
            used = {("lookup", r.req_id, self.latest.get(r.req_id)) for r in loads}
            self.consumed |= used
        w.start_load_kv()
        computed = [(self.kv(t, a, b), *self._slots(blocks, a, b)) for t, blocks, a, b in inputs]
        for layer, name in enumerate(self.caches):
            w.wait_for_layer_load(name)
            for kv, blk, off in computed:  # the forward writes this step's KV
                self.caches[name][blk, :, off, :] = kv[layer]
            w.save_kv_layer(name)
        w.wait_for_save()
        w.get_finished(finished)
        bad = w.get_block_ids_with_load_errors()
        if bad:  # vLLM recomputes these blocks: a promised hit did not load
            self.errors.append(f"step {step}: load errors in blocks {sorted(bad)}")
            self.load_errors |= bad
        late = [c for c in self.rec.in_flight() if c.label in used] if self.rec else []
        if late:  # the loads' leases are gone: their hits' copies must have been waited for
            labels = sorted({str(c.label) for c in late})
            self.errors.append(f"step {step}: loaded hits' copies still in flight: {labels}")
        return loads

    def _check_load(self, step: int, r: Any) -> None:
        """The tokens ``r`` loaded (all but blocks reported as load errors) hold their KV."""
        a, b = r.load.vllm_cached, r.load.load_end
        blk, off = self._slots(r.block_ids, a, b)
        got = torch.stack([c[blk, :, off, :] for c in self.caches.values()])
        wrong = got.view(torch.int16) != self.kv(r.token_ids, a, b).view(torch.int16)
        errors = [int(x) in self.load_errors for x in blk.tolist()]
        diff = int(
            (wrong.flatten(2).any(-1).any(0) & ~torch.tensor(errors, device=blk.device)).sum()
        )
        self.counts["loads"] += 1
        self.counts["loaded_tokens"] += b - a
        if diff:
            self.errors.append(f"step {step}: {r.req_id} tokens [{a}, {b}): {diff} tokens differ")

    # -- which copies serve which lookup (the recording stand-in) -----------------------------

    def _label_lookups(self, rec: RecordingBackend) -> None:
        """Label each lookup's copies (its hit's prefetch) ``("lookup", request, n)``."""
        server = self.worker._lookup_server  # it was given the bound method: patch what it calls
        assert server is not None
        real = server._lookup

        def lookup(query: Any) -> int:
            rid = query.req_id
            with self._lock:
                n = self.lookups[rid] = self.lookups.get(rid, 0) + 1
            with rec.labelled(("lookup", rid, n)):
                found = real(query)
            with self._lock:
                self.latest[rid] = n
            return found

        server._lookup = lookup

    # -- the run -------------------------------------------------------------------------------

    def run(self, timeout: float) -> None:
        def guarded(fn: Any, *args: Any) -> Any:
            def body() -> None:
                try:
                    fn(*args)
                except BaseException:
                    self.errors.append(traceback.format_exc())
                    self.stop.set()  # the other threads end too

            return body

        clients = [
            threading.Thread(target=guarded(self.client, i), name=f"client-{i}")
            for i in range(self.size.clients)
        ]
        sched = threading.Thread(target=guarded(self.scheduler_loop, clients), name="scheduler")
        work = threading.Thread(target=guarded(self.worker_loop), name="worker")
        for t in (*clients, sched, work):
            t.start()
        deadline = time.monotonic() + timeout
        for t in (*clients, sched, work):
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                self.errors.append(f"thread {t.name} still running after {timeout:.0f} s")
                self.stop.set()

    def close(self) -> None:
        self.scheduler.close()
        self.worker.shutdown()


@contextlib.contextmanager
def _device(kind: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[torch.device]:
    """The caches' device: the recording stand-in of a CUDA device (CPU tensors, pages as on
    CUDA), or a real GPU."""
    if kind == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA GPU")
        yield torch.device("cuda", 0)
        return
    monkeypatch.setattr(device_registry, "_BACKENDS", dict(device_registry._BACKENDS))
    register_backend(RecordingBackend("cpu"), clobber=True)
    monkeypatch.setattr(kv_registration, "probe_cpu_kv_format", lambda *a: "kv_concat")
    yield torch.device("cpu")


@contextlib.contextmanager
def _errors(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Errors logged by lmcache, and exceptions no thread caught, while inside."""
    found: list[str] = []

    class _Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            found.append(self.format(record))

    handler = _Handler(logging.ERROR)
    loggers = [logging.getLogger(n) for n in ("lmcache", "lmcache_vllm")]
    monkeypatch.setattr(threading, "excepthook", lambda a: found.append(repr(a.exc_value)))
    for lg in loggers:
        lg.addHandler(handler)
    try:
        yield found
    finally:
        for lg in loggers:
            lg.removeHandler(handler)


@pytest.mark.parametrize("layerwise", [False, True], ids=["batched", "layerwise"])
@pytest.mark.parametrize(
    "kind",
    [pytest.param("cpu", marks=pytest.mark.slow), pytest.param("cuda", marks=pytest.mark.gpu)],
)
def test_worker_stress(kind: str, layerwise: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    size = CPU if kind == "cpu" else GPU
    with _device(kind, monkeypatch) as device, _errors(monkeypatch) as logged:
        stress = Stress(size, device, layerwise, seed=17)
        with watch_host_memory(stress.backend) as canaries:
            try:
                # on the CPU a busy copy thread: saves read the pages late (a GPU is late itself)
                with slow_save_copies(0.002) if kind == "cpu" else contextlib.nullcontext():
                    stress.run(timeout=600)
                held = stress.worker.held_leases
                stats = stress.worker.take_stats() or {}
                sched = stress.scheduler.take_stats() or {}
                evicted = stress.engine.metrics.value("evicted_chunks")
            finally:
                stress.close()
            reset_process_cpu_tiers()  # the tier lets go of its chunks: nothing else holds any
            used = stress.engine.pool.used_bytes
            violations = canaries.check()  # waits for the device first
    summary = (
        f"{stress.counts}, evicted {evicted:.0f} (buffers reused {canaries.recycled}), canaries "
        f"{canaries.released} filled / {canaries.reused} checked at reuse, copies of hits "
        f"dropped unused {canaries.abandoned}"
    )
    assert not stress.errors, "\n".join(stress.errors[:20]) + f"\n{summary}"
    assert not violations, "\n".join(violations) + f"\n{canaries.count} in all; {summary}"
    assert not logged, logged[:5]
    assert held == 0 and used == 0, f"{held} hits held, {used} bytes leased after the run"
    assert stats.get("failed_load_tokens", 0) == 0 and stats.get("checksum_failures", 0) == 0, stats
    assert sched.get("scheduler_failures", 0) == 0, sched
    # the run did what it is for: loads, aborts, preemptions, evictions, memory handed back
    counts = stress.counts
    assert counts["loads"] > 10 and counts["aborts"] > 0 and counts["preempted"] > 0, summary
    assert evicted > 0 and canaries.released > 0, summary
    assert canaries.reused + canaries.recycled > 0, summary
