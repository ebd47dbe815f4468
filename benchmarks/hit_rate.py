# SPDX-License-Identifier: Apache-2.0
"""Tokens hit under memory pressure: lmcache's eviction order next to plain per-chunk LRU and an
unbounded cache, on one synthetic multi-turn trace.

The trace (seeded) has ``--sessions`` chat sessions, each over one of ``--system-prompts`` shared
system prompts. Requests pick a session by Zipf popularity (``--zipf``); a session's request is
its previous prompt, the previous answer and a new user turn (a fresh conversation after
``--turns`` turns). The trace's *working set* is the number of distinct full chunks it contains.

Each capacity (25 %, 50 % and 100 % of the working set, in chunks) replays the trace three ways:

- **lmcache**: a real :class:`~lmcache.cache_engine.LMCacheEngine` over a :class:`~lmcache.tiers.
  CPUTier` holding that many chunks, driven as a serving engine drives it: ``lookup``, then
  ``retrieve`` of the hit (into a paged CPU cache through
  :class:`~lmcache.testing.PagedCPUConnector`), then ``store`` with the hit masked. Tiny chunk
  tensors (1 layer, 1 KV head of 4), so the run measures the policy, not memory bandwidth.
- **plain LRU**: a per-chunk LRU of the same capacity: a lookup touches the hit chunks in order,
  a store inserts the missing ones in order, each evicting the least recently used chunk.
- **unbounded**: every chunk ever stored stays.

It prints the tokens hit by each (and their share of the unbounded figure), one line per capacity
saying whether lmcache >= plain LRU, and a check that one prompt larger than the tier, repeated,
hits the same number of tokens every time after the first. It exits 1 if either fails. Run with
``nox -s bench`` or ``python benchmarks/hit_rate.py [--seed N] [--sessions N] [--requests N]``
(core venv: needs only torch and lmcache; ~6 s on 2 cores with the defaults). The gap between
the policies grows as the tier shrinks relative to single prompts: ``--capacities 2,5,10``.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import random
import sys
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lmcache.cache_engine import LMCacheEngine
from lmcache.config import LMCacheConfig
from lmcache.gpu_connector.interface import EngineInfo, TransferSpec
from lmcache.keys import chunk_keys
from lmcache.memory import HostMemoryPool, aligned_bytes
from lmcache.metadata import LMCacheMetadata
from lmcache.metrics import LMCacheMetrics
from lmcache.testing import PagedCPUConnector
from lmcache.tiers import CPUTier

LAYERS, KV_HEADS, HEAD = 1, 1, 4
WIDTH = 2 * KV_HEADS * HEAD
DTYPE = torch.bfloat16
VOCAB = 32_000


@dataclass(frozen=True)
class Trace:
    """Prompts (token ids) in arrival order, and their full chunks' keys."""

    prompts: list[list[int]]
    keys: list[list[bytes]]
    chunk_size: int

    @property
    def working_set(self) -> int:
        """Distinct full chunks in the trace."""
        return len({k for keys in self.keys for k in keys})

    @property
    def tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def _metadata(chunk_size: int) -> LMCacheMetadata:
    return LMCacheMetadata(
        "benchmark/hit-rate",
        1,
        0,
        0,
        1,
        DTYPE,
        LAYERS,
        KV_HEADS,
        HEAD,
        HEAD,
        chunk_size=chunk_size,
    )


def full_chunk_keys(tokens: Sequence[int], chunk_size: int) -> list[bytes]:
    """The keys of a prompt's full chunks, exactly as the engine computes them (its salt is
    ``config.cache_salt + "\\0" + request salt``, both empty here)."""
    n = len(tokens) // chunk_size * chunk_size
    return chunk_keys(list(tokens[:n]), _metadata(chunk_size).fingerprint(), chunk_size, salt="\0")


def make_trace(
    *,
    seed: int,
    sessions: int,
    requests: int,
    system_prompts: int,
    turns: int,
    zipf: float,
    chunk_size: int,
) -> Trace:
    """A seeded multi-turn trace (see the module docstring). Lengths are in tokens and not
    chunk-aligned: a prompt's partial last chunk is never stored (``save_unfull_chunk`` off)."""
    rng = random.Random(seed)
    cs = chunk_size

    def text(lo: int, hi: int) -> list[int]:
        return [rng.randrange(1, VOCAB) for _ in range(rng.randint(lo, hi))]

    systems = [text(4 * cs, 12 * cs) for _ in range(system_prompts)]
    system_of = [rng.randrange(system_prompts) for _ in range(sessions)]
    weights = [1.0 / (rank + 1) ** zipf for rank in range(sessions)]
    order = list(range(sessions))
    rng.shuffle(order)  # popularity rank is not session id
    history: list[list[int] | None] = [None] * sessions
    answer: list[list[int]] = [[] for _ in range(sessions)]
    turn = [0] * sessions
    prompts: list[list[int]] = []
    for _ in range(requests):
        s = order[rng.choices(range(sessions), weights)[0]]
        if history[s] is None or turn[s] >= turns:
            prompt = systems[system_of[s]] + text(cs // 2, 3 * cs)
            turn[s] = 0
        else:
            prev = history[s]
            assert prev is not None
            prompt = prev + answer[s] + text(cs // 4, 2 * cs)
        history[s] = prompt
        answer[s] = text(cs // 2, 3 * cs)
        turn[s] += 1
        prompts.append(prompt)
    return Trace(prompts, [full_chunk_keys(p, cs) for p in prompts], cs)


# ------------------------------------------------------------------------------ replays


class LMCacheReplay:
    """A real engine over a CPU tier of ``capacity`` chunks, driven like a serving engine."""

    def __init__(self, capacity: int, chunk_size: int, max_tokens: int) -> None:
        self.config = LMCacheConfig(chunk_size=chunk_size, max_local_cpu_size=1.0)
        self.metadata = _metadata(chunk_size)
        budget = capacity * aligned_bytes(LAYERS * chunk_size * WIDTH * DTYPE.itemsize)
        pool = HostMemoryPool(budget, pin=False, slab_bytes=max(budget, 1))
        self.tier = CPUTier(pool, LMCacheMetrics())
        caches = [torch.zeros(max_tokens, 1, WIDTH, dtype=DTYPE) for _ in range(LAYERS)]
        info = EngineInfo("mock", "cpu", caches, extra={"page_size": 1})
        connector = PagedCPUConnector(self.config, self.metadata, info)
        self.engine = LMCacheEngine(
            self.config, self.metadata, connector, tier=self.tier, lower_tiers=()
        )

    def request(self, prompt: Sequence[int]) -> int:
        """Serve one prompt: lookup, load the hit, store the rest. Returns the tokens hit."""
        tokens = torch.tensor(prompt, dtype=torch.long)
        spec = TransferSpec(torch.arange(len(prompt)))
        hit = self.engine.lookup(tokens)
        if hit:
            loaded = int(self.engine.retrieve(tokens, None, spec).sum())
            if loaded != hit:
                raise RuntimeError(f"lookup promised {hit} tokens, retrieve loaded {loaded}")
        mask = torch.ones(len(prompt), dtype=torch.bool)
        mask[:hit] = False
        self.engine.store(tokens, mask, spec)
        return hit

    def close(self) -> None:
        self.engine.close()


class PlainLRU:
    """Per-chunk LRU of ``capacity`` chunks: no chain order, no orphans, no protection."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.chunks: OrderedDict[bytes, None] = OrderedDict()

    def request(self, keys: Sequence[bytes], chunk_size: int) -> int:
        hit = 0
        while hit < len(keys) and keys[hit] in self.chunks:
            hit += 1
        for key in keys[:hit]:  # the lookup uses the hit chunks in order
            self.chunks.move_to_end(key)
        for key in keys[hit:]:  # the store inserts the others in order
            if key in self.chunks:
                self.chunks.move_to_end(key)
                continue
            if self.capacity <= 0:
                break
            if len(self.chunks) >= self.capacity:
                self.chunks.popitem(last=False)
            self.chunks[key] = None
        return hit * chunk_size


class Unbounded:
    """Every chunk ever stored stays."""

    def __init__(self) -> None:
        self.chunks: set[bytes] = set()

    def request(self, keys: Sequence[bytes], chunk_size: int) -> int:
        hit = 0
        while hit < len(keys) and keys[hit] in self.chunks:
            hit += 1
        self.chunks.update(keys)
        return hit * chunk_size


def replay(trace: Trace, capacity: int) -> tuple[int, int]:
    """Tokens hit over the trace by lmcache and by plain LRU, both holding ``capacity``."""
    ours = LMCacheReplay(capacity, trace.chunk_size, max(len(p) for p in trace.prompts))
    lru = PlainLRU(capacity)
    hit_ours = hit_lru = 0
    try:
        for prompt, keys in zip(trace.prompts, trace.keys, strict=True):
            hit_ours += ours.request(prompt)
            hit_lru += lru.request(keys, trace.chunk_size)
    finally:
        ours.close()
    return hit_ours, hit_lru


def repeated_prompt(
    capacity: int, chunks: int, runs: int, chunk_size: int
) -> tuple[list[int], list[int]]:
    """Hits of one ``chunks``-chunk prompt sent ``runs`` times into ``capacity`` chunks:
    (lmcache's, plain LRU's)."""
    rng = random.Random(1234)
    prompt = [rng.randrange(1, VOCAB) for _ in range(chunks * chunk_size)]
    keys = full_chunk_keys(prompt, chunk_size)
    ours = LMCacheReplay(capacity, chunk_size, len(prompt))
    lru = PlainLRU(capacity)
    try:
        hits_ours = [ours.request(prompt) for _ in range(runs)]
    finally:
        ours.close()
    hits_lru = [lru.request(keys, chunk_size) for _ in range(runs)]
    return hits_ours, hits_lru


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="trace seed (default 0)")
    parser.add_argument("--sessions", type=int, default=200, help="chat sessions (default 200)")
    parser.add_argument("--requests", type=int, default=1200, help="requests (default 1200)")
    parser.add_argument("--system-prompts", type=int, default=4, help="shared (default 4)")
    parser.add_argument("--turns", type=int, default=8, help="turns per conversation (8)")
    parser.add_argument("--zipf", type=float, default=0.8, help="popularity exponent (0.8)")
    parser.add_argument("--chunk-size", type=int, default=16, help="tokens per chunk (16)")
    parser.add_argument(
        "--capacities",
        default="25,50,100",
        help="tier sizes in %% of the working set, comma-separated (default 25,50,100)",
    )
    args = parser.parse_args()
    logging.getLogger("lmcache").setLevel(logging.WARNING)

    print(
        f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, python {platform.python_version()}",
        flush=True,
    )
    print(f"command: {' '.join([os.path.basename(sys.executable), *sys.argv])}", flush=True)
    started = time.perf_counter()
    trace = make_trace(
        seed=args.seed,
        sessions=args.sessions,
        requests=args.requests,
        system_prompts=args.system_prompts,
        turns=args.turns,
        zipf=args.zipf,
        chunk_size=args.chunk_size,
    )
    unbounded = Unbounded()
    hit_all = sum(unbounded.request(keys, trace.chunk_size) for keys in trace.keys)
    ws = trace.working_set
    print(
        f"trace: {len(trace.prompts)} requests, {args.sessions} sessions, "
        f"{args.system_prompts} system prompts, zipf {args.zipf}, seed {args.seed}: "
        f"{trace.tokens} prompt tokens, working set {ws} chunks of {trace.chunk_size} tokens",
        flush=True,
    )
    ok = True
    rows: list[tuple[int, int, int, int]] = []
    for pct in (int(p) for p in args.capacities.split(",")):
        capacity = max(1, ws * pct // 100)
        print(f"replaying at {pct} % ({capacity} chunks) ...", flush=True)
        ours, lru = replay(trace, capacity)
        rows.append((pct, capacity, ours, lru))

    print()
    print(f"| {'capacity':<18} | {'lmcache':>16} | {'plain LRU':>16} | {'unbounded':>10} |")
    print(f"|{'-' * 20}|{'-' * 18}|{'-' * 18}|{'-' * 12}|")
    for pct, capacity, ours, lru in rows:
        label = f"{pct:>3} % ({capacity} ch)"
        print(
            f"| {label:<18} | {ours:>9} ({ours / hit_all:4.0%}) | {lru:>9} ({lru / hit_all:4.0%}) "
            f"| {hit_all:>10} |"
        )
    print("(tokens hit over the trace; % of the unbounded cache's hits)")
    print()
    for pct, _, ours, lru in rows:
        verdict = "ok" if ours >= lru else "FAILED"
        ok &= ours >= lru
        print(f"{pct:>3} %: lmcache {ours} >= plain LRU {lru}: {verdict}")

    room = 8
    chunks = room * 7 // 4
    ours_runs, lru_runs = repeated_prompt(room, chunks, 6, trace.chunk_size)
    stable = len(set(ours_runs[1:])) == 1 and ours_runs[1] > 0
    ok &= stable
    print(
        f"repeated prompt of {chunks} chunks into room for {room}, 6 runs: lmcache {ours_runs}, "
        f"plain LRU {lru_runs}: lmcache {'stable' if stable else 'UNSTABLE'} after the first"
    )
    print(f"({time.perf_counter() - started:.1f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
