# SPDX-License-Identifier: Apache-2.0
"""Overwritten chunks on real vLLM (CPU), checksums on: caught, recomputed, output unchanged.

For each kind of hit a stored chunk is damaged where that hit reads it from. The batched and the
layerwise load read lmcache's host tier. A disk-only hit (``local_cpu: false``) and a disk hit
promoted into an emptied host tier (as after a restart) read the disk tier. The damage is one
flipped bit, or the chunk's bytes replaced by another stored chunk's: on disk its payload
(the payload checksum catches it), or its whole file (the key in the file's header catches it).

Every case checks four things. The hit ends before the bad chunk. No promised token fails to load.
vLLM's greedy output equals its output without lmcache. The bad chunk left its tier and the
recompute stored the good one in its place.

One engine per kind of hit serves all of its cases (a module-scoped fixture, 4 engine starts), so
each case leaves the tiers as it found them and first checks that the intact chunks hit in full.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from lmcache.keys import chunk_keys
from lmcache.tiers.chunk_format import HEADER_BYTES, ChunkHeader

from .conftest import CHUNK, PROMPTS, ktc, live_engine, metrics_of
from .test_tiers import _disk, _Engine

pytestmark = pytest.mark.slow

PROMPT = "p300"  # 4 full chunks of 64 tokens (stored) + a 44-token tail (not stored)
FULL = 4
BAD = 2  # the damaged chunk: every damaged hit ends at BAD * CHUNK = 128 tokens (block-aligned)
CONFIGS = {  # lmcache settings per kind of hit; "disk*" kinds add a disk folder
    "batched": {},
    "layerwise": {"use_layerwise": True},
    "disk": {"local_cpu": False},
    "disk_promoted": {},
}
HOST_CASES = [(k, d) for k in ("batched", "layerwise") for d in ("flipped_bit", "other_chunk")]
DISK_CASES = [
    (k, d)
    for k in ("disk", "disk_promoted")
    for d in ("flipped_bit", "other_payload", "other_file")
]


@dataclass
class Hit:
    """A kind of hit: its engine, the prompt's chunk keys and the disk folder (if any)."""

    kind: str
    eng: _Engine
    keys: list[bytes]
    folder: Path | None


@pytest.fixture
def fresh_lmcache() -> Iterator[None]:
    """Replaces conftest's per-test reset: an engine keeps its tiers across its cases, and
    :func:`hit` resets them around each engine instead."""
    yield


@pytest.fixture(scope="module")
def hit(request, model_dir, baseline, tmp_path_factory) -> Iterator[Hit]:
    """The engine of one kind of hit (``request.param``), after a cold run stored the prompt."""
    from lmcache.tiers import reset_process_cpu_tiers

    kind = request.param
    folder = tmp_path_factory.mktemp(kind) / "kv" if kind.startswith("disk") else None
    cfg = CONFIGS[kind]
    reset_process_cpu_tiers()
    try:
        with _Engine(
            model_dir,
            ktc(checksum=True, **cfg) if folder is None else _disk(folder, checksum=True, **cfg),
        ) as eng:
            engine = live_engine()
            assert (engine.config.use_layerwise, engine.config.local_cpu) == (
                kind == "layerwise",
                kind != "disk",
            )
            assert eng.gen(PROMPT) == (baseline[PROMPT], 0)
            fingerprint = engine.metadata.fingerprint()
            keys = chunk_keys(PROMPTS[PROMPT], fingerprint, CHUNK, salt="\0")[:FULL]
            yield Hit(kind, eng, keys, folder)
    finally:
        reset_process_cpu_tiers()


def _metric(name: str) -> float:
    return live_engine().metrics.value(name)


def _eventually(check: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.05)


def _chunk_files(folder: Path) -> dict[bytes, Path]:
    """The chunk files under ``folder``, by the key their header names."""
    out = {}
    for path in folder.rglob("*.lmc"):
        with path.open("rb") as f:
            out[ChunkHeader.decode(f.read(HEADER_BYTES)).key] = path
    return out


def _stored(hit: Hit) -> dict[bytes, Path]:
    """Wait until the prompt's chunks are stored (saves commit, and disk writes land, after the
    request returns); the disk files by key."""
    tier = live_engine().tier

    def done() -> bool:
        if hit.kind != "disk" and not all(tier.contains(k) for k in hit.keys):
            return False
        if hit.folder is None:
            return True
        hit.eng.flush()
        return _chunk_files(hit.folder).keys() == set(hit.keys)

    _eventually(done, "every full chunk is stored")
    return {} if hit.folder is None else _chunk_files(hit.folder)


def _no_failed_loads(hit: Hit) -> None:
    m = metrics_of(hit.eng.llm)
    assert m.get("vllm:lmcache_failed_load_tokens", 0) == 0, m


@pytest.mark.parametrize(("hit", "damage"), HOST_CASES, indirect=["hit"], scope="module")
def test_host_tier_chunk_overwritten(hit, baseline, damage):
    """Checked at lookup: the lookup leases only the verified prefix (nothing to fail later)."""
    tier = live_engine().tier
    want = baseline[PROMPT]
    assert hit.eng.gen(PROMPT) == (want, FULL * CHUNK)  # intact: every full chunk hits
    _stored(hit)
    entry = tier._entries[hit.keys[BAD]]
    good = entry.lease.tensor.clone()
    failures = _metric("checksum_failures")
    with torch.inference_mode():  # the pool's slabs were allocated inside vLLM's inference mode
        data = entry.lease.tensor.view(-1).view(torch.uint8)
        if damage == "flipped_bit":
            data[12345] ^= 0x10
        else:
            data.copy_(tier._entries[hit.keys[BAD - 1]].lease.tensor.view(-1).view(torch.uint8))
    assert hit.eng.gen(PROMPT) == (want, BAD * CHUNK)
    assert _metric("checksum_failures") == failures + 1
    _no_failed_loads(hit)
    _stored(hit)
    assert tier._entries[hit.keys[BAD]] is not entry  # the bad entry left; a new one came
    torch.testing.assert_close(tier._entries[hit.keys[BAD]].lease.tensor, good, rtol=0, atol=0)


@pytest.mark.parametrize(("hit", "damage"), DISK_CASES, indirect=["hit"], scope="module")
def test_disk_chunk_overwritten(hit, baseline, damage):
    """Checked when read: the disk tier verifies each chunk before the lookup leases it."""
    tier = live_engine().tier
    want = baseline[PROMPT]

    def from_disk() -> tuple[tuple[list[int], int], float]:
        """The request's (tokens, cached tokens), and how many chunks it read from disk."""
        if hit.kind == "disk_promoted":
            tier.clear()  # the host tier a restart leaves: every hit reads the disk
        before = _metric("disk_hit_chunks")
        out = hit.eng.gen(PROMPT)
        return out, _metric("disk_hit_chunks") - before

    files = _stored(hit)
    assert from_disk() == ((want, FULL * CHUNK), FULL)  # intact: every full chunk hits
    victim, other = files[hit.keys[BAD]], files[hit.keys[BAD - 1]].read_bytes()
    original = victim.read_bytes()
    if damage == "flipped_bit":
        data = bytearray(original)
        data[-2] ^= 0x01
        victim.write_bytes(bytes(data))
    elif damage == "other_payload":  # the header still names this chunk and its checksum
        victim.write_bytes(original[:HEADER_BYTES] + other[HEADER_BYTES:])
    else:  # a whole valid file of another chunk under this chunk's name
        victim.write_bytes(other)
    failures = _metric("checksum_failures")
    assert from_disk() == ((want, BAD * CHUNK), BAD)
    assert _metric("checksum_failures") == failures + 1
    _no_failed_loads(hit)
    if hit.kind == "disk_promoted":  # the chunks before the bad one were promoted
        assert [tier.contains(k) for k in hit.keys[:BAD]] == [True] * BAD
    else:
        assert len(tier) == 0  # local_cpu false: host memory only stages
    _stored(hit)  # the bad file was deleted, and the recompute wrote the chunk again
    assert victim.read_bytes() == original
