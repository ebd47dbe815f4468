# SPDX-License-Identifier: Apache-2.0
"""One engine process of ``node_gpu.py``: ``python node_gpu_engine.py SPEC_JSON``.

Roles (``SPEC["role"]``):

- ``base``: vLLM alone; cold TTFT of the prompts Q, then the floor (the same prompts again, vLLM's
  own prefix-cache hits).
- ``A``: lmcache's node cache; cold TTFT of the prompts P (it stores them), the floor,
  ``reset_prefix_cache()``, warm TTFT of P (its own chunks, from the node cache). It then writes
  its result and stays alive, idle, until ``B.done`` appears in the work folder.
- ``B``: the node cache, started after A stored P; cold TTFT of Q (nobody stored them), the
  floor, ``reset_prefix_cache()``, warm TTFT of P (chunks engine A stored: hits across
  processes), then warm TTFT of Q (its own chunks).

Every request is greedy with ``max_tokens`` tokens (the correctness check compares them) and is
timed by vLLM (``RequestOutput.metrics.first_token_latency``). Each role writes
``<role>.json`` into the work folder. A phase skips its remaining prompts when the next one
would pass ``SPEC["deadline"]`` (``--budget-s``), keeping at least one.

Also ``node_gpu.py``'s node cache owner: its folder (:func:`node_folder`), its start
(:func:`start_owner`) and its counters (:func:`owner_stats`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import RunResult, log, quiet_third_party, run_prompt

GIB = 1 << 30
WARMUP_TOKENS = 512
METRICS = ("stored_chunks", "hit_tokens", "loaded_chunks", "checksum_failures", "tier_errors")


def arena_state() -> dict[str, Any]:
    """The node arena this process maps: its size and whether it is page-locked (after waiting
    for the background pinning, so that no timed load copies from pageable memory)."""
    from lmcache_vllm.vllm_v1_adapter import live_engines

    for engine in live_engines():
        client = getattr(engine.tier, "client", None)
        arena = getattr(client, "_arena", None)  # NodeClient's current mapping
        if arena is None:
            continue
        if arena.pinning is not None:
            arena.pinning.join(timeout=600)
        return {"bytes": int(arena.data.numel()), "pinned": bool(arena.registered)}
    return {}


def lmcache_metrics() -> dict[str, float]:
    from lmcache_vllm.vllm_v1_adapter import live_engines

    out: dict[str, float] = {}
    for engine in live_engines():
        for name in METRICS:
            out[name] = out.get(name, 0.0) + float(engine.metrics.value(name))
    return out


class Runner:
    """Runs the phases of one engine and keeps their requests."""

    def __init__(self, llm: Any, spec: dict[str, Any]) -> None:
        self.llm = llm
        self.spec = spec
        self.slowest = 0.0  # wall seconds of the slowest request so far
        self.phases: dict[str, list[dict[str, Any]]] = {}
        self.notes: list[str] = []

    def one(self, prompt: list[int]) -> RunResult:
        out = run_prompt(self.llm, prompt, self.spec["max_tokens"])
        self.slowest = max(self.slowest, out.wall_s)
        return out

    def phase(self, name: str, prompts: list[list[int]]) -> int:
        """Run ``prompts`` as phase ``name``; returns how many ran (at least one)."""
        rows = self.phases.setdefault(name, [])
        for i, prompt in enumerate(prompts):
            if i and time.time() + 2 * self.slowest + 5 > self.spec["deadline"]:
                self.notes.append(
                    f"{name}: {len(prompts) - i} of {len(prompts)} prompts skipped (--budget-s)"
                )
                break
            before = lmcache_metrics()
            out = self.one(prompt)
            # lmcache's own counts (vLLM 0.26 has no external-hit counter: it reads 0 there):
            # the tokens its lookup found, if chunks were then loaded
            after = lmcache_metrics()
            moved = after.get("loaded_chunks", 0.0) > before.get("loaded_chunks", 0.0)
            loaded = after.get("hit_tokens", 0.0) - before.get("hit_tokens", 0.0) if moved else 0
            rows.append(
                {
                    "ttft_ms": 1e3 * out.ttft_s,
                    "ttft_source": out.ttft_source,
                    "tokens": out.token_ids,
                    "cached": out.num_cached_tokens,
                    "external": max(out.external_hits, int(loaded)),
                }
            )
        log(
            f"{self.spec['role']} {name}: TTFT (ms) "
            + " ".join(f"{r['ttft_ms']:.1f}" for r in rows)
            + "; tokens cached "
            + " ".join(str(r["cached"]) for r in rows)
        )
        return len(rows)

    def warm_up(self, prompt: list[int]) -> None:
        """A short prompt three times: computed, vLLM's own hit, and after a reset lmcache's hit
        of its own store (a recompute for vLLM alone): each path's first call is slow."""
        self.one(prompt)
        self.one(prompt)
        self.reset()
        self.one(prompt)

    def reset(self) -> None:
        if not self.llm.reset_prefix_cache():
            self.notes.append("reset_prefix_cache() returned False")


def run_role(runner: Runner, spec: dict[str, Any], work: Path) -> None:
    from lmcache_vllm.testing import make_prompt

    def prompts(seeds: list[int]) -> list[list[int]]:
        return [make_prompt(spec["tokens"], seed=s, vocab_size=spec["vocab"]) for s in seeds]

    role = spec["role"]
    runner.warm_up(make_prompt(WARMUP_TOKENS, seed=spec["warmup_seed"], vocab_size=spec["vocab"]))
    runner.reset()  # the warm-up's blocks out of vLLM's prefix cache: the phases start alike
    if role == "base":
        q = prompts(spec["Q"])
        n = runner.phase("cold", q)
        runner.phase("floor", q[:n])
    elif role in ("A", "local"):  # local: per-process lmcache, the default mode, on prompts R
        p = prompts(spec["P"] if role == "A" else spec["R"])
        n = runner.phase("cold", p)
        runner.phase("floor", p[:n])
        runner.reset()
        runner.phase("warm", p[:n])
    elif role == "B":
        p, q = prompts(spec["P"]), prompts(spec["Q"])
        n = runner.phase("cold", q)
        runner.phase("floor", q[:n])
        runner.reset()
        runner.phase("warm", p)  # A's chunks: this process never saw these prompts
        runner.phase("own", q[:n])  # its own chunks (vLLM's prefix cache holds only P now)
    else:
        raise SystemExit(f"unknown role {role!r}")


# ------------------------------------------------ the run's node cache owner (node_gpu.py)


def node_folder(need: int, least: int) -> tuple[Path, int]:
    """A new private folder (0700) for the owner's arena and the budget it gets: ``need`` bytes
    where a tmpfs (``/dev/shm`` first) has room, else ``least``; a disk folder last."""
    tmpfs = ["/dev/shm"]
    with open("/proc/mounts") as mounts:
        for line in mounts:
            _, where, kind, *_ = line.split()
            if kind == "tmpfs" and where not in tmpfs and not where.startswith(("/sys", "/proc")):
                tmpfs.append(where)
    candidates = [*tmpfs, tempfile.gettempdir()]
    for budget in (need, least):
        for where in candidates:
            if not os.path.isdir(where) or not os.access(where, os.W_OK | os.X_OK):
                continue
            if shutil.disk_usage(where).free >= budget + (512 << 20):
                folder = Path(tempfile.mkdtemp(prefix="lmcache-node-", dir=where))
                if where not in tmpfs:
                    print(
                        f"NOTE: no tmpfs with {budget / GIB:.1f} GiB free: the arena is a disk "
                        "file; page-locking a file mapping may be refused (loads then pageable)",
                        flush=True,
                    )
                return folder, budget
    raise SystemExit(
        f"no folder has {least / GIB:.1f} GiB free for the node cache arena (tried "
        f"{', '.join(candidates)}); lower --reps or --tokens"
    )


def start_owner(folder: Path, budget: int, idle_exit_s: float) -> subprocess.Popen[bytes]:
    """The owner of ``folder`` (its output in ``folder/owner.log``), once it answers."""
    from lmcache.node.spawn import spawn_owner
    from lmcache.testing.node_owner import NodeOwner

    proc = spawn_owner(folder, budget, idle_exit_s)
    if proc is None:
        raise SystemExit("could not start the node cache owner")
    probe = NodeOwner(folder, budget)  # only its socket probe
    deadline = time.monotonic() + 120  # posix_fallocate of tens of GiB takes seconds
    while probe.generation() is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            log_file = folder / "owner.log"
            raise SystemExit(
                "node cache owner did not start: "
                + (log_file.read_text()[-2000:] if log_file.exists() else "")
            )
        time.sleep(0.1)
    return proc


def owner_stats(folder: Path) -> str:
    """The owner's counters (entries, bytes, sessions, leases, evictions), one request."""
    import socket

    from lmcache.node import wire
    from lmcache.node.arena import SOCKET_NAME

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5.0)
    try:
        sock.connect(str(folder / SOCKET_NAME))
        sock.sendall(wire.encode(wire.Hello(wire.PROTOCOL_VERSION, os.urandom(16), 0, "", [])))
        wire.read_frame(sock)  # the welcome
        sock.sendall(wire.encode(wire.Stats()))
        reply = wire.decode_reply(wire.read_frame(sock))
    except (OSError, wire.FrameError) as exc:
        return f"no answer ({exc})"
    finally:
        sock.close()
    names = ("entries", "used_bytes", "budget_bytes", "sessions", "leased_blocks", "evicted")
    return ", ".join(f"{n} {getattr(reply, n, '?')}" for n in names)


def main() -> None:
    spec = json.loads(sys.argv[1])
    quiet_third_party(spec["verbose"])
    import vllm_gpu_runs as runs

    runs.ENGINE_MEMORY = spec["memory"]
    work = Path(spec["work"])
    role = spec["role"]
    kv = spec["kv"]
    result: dict[str, Any] = {"role": role}
    start = time.perf_counter()
    with runs.fresh_engine(
        "base" if kv is None else "lmcache", Path(spec["model"]), kv or {}, spec["max_len"]
    ) as llm:
        result["arena"] = arena_state() if kv is not None else {}
        result["startup_s"] = time.perf_counter() - start
        runner = Runner(llm, spec)
        run_role(runner, spec, work)
        result["phases"] = runner.phases
        result["notes"] = runner.notes
        result["lmcache"] = lmcache_metrics() if kv is not None else {}
        import vllm

        result["vllm"] = vllm.__version__
        tmp = work / f"{role}.json.tmp"
        tmp.write_text(json.dumps(result))
        tmp.rename(work / f"{role}.json")  # whole or absent for the parent
        if role == "A":  # hold the chunks' engine alive on the device until B is done
            log("A: waiting for B")
            while not (work / "B.done").exists() and time.time() < spec["hard_end"]:
                time.sleep(0.2)
    log(f"{role}: done")


if __name__ == "__main__":
    main()
