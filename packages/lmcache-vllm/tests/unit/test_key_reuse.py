# SPDX-License-Identifier: Apache-2.0
"""The worker's load reuses the chunk keys its lookup computed, and only where they match.

Over the real scheduler and worker sides (a real lookup server, cache engine and CPU caches in
vLLM's layout): the keys a load passes to the engine are compared with a recompute by
``chunk_keys``, the hash calls of the load are counted, and the loaded pages are compared bit
for bit with the pages saved for the load's own tokens.
"""

from __future__ import annotations

import pickle
import socket

import numpy as np
import pytest
import torch

import lmcache.keys
import lmcache_vllm.scheduler.lookup_client
from lmcache.cache_engine import HeldHit
from lmcache.keys import chunk_keys
from lmcache_vllm.connector_metadata import LoadSpec, ReqMeta
from lmcache_vllm.lookup_wire import LookupQuery, decode_request, encode_lookup
from lmcache_vllm.worker.lookup_leases import LookedUp

from .test_lease_on_lookup import BLOCK, PROMPT, Rig, _prompt, _request


@pytest.fixture(params=["in-process", "socket"])
def via(request, monkeypatch):
    """How the scheduler reaches the worker's lookup server: a direct call (one process, the
    prompt list itself) or its socket (vLLM's multiprocess ranks: the tokens are decoded)."""
    if request.param == "socket":
        monkeypatch.setattr(lmcache_vllm.scheduler.lookup_client, "local_server", lambda path: None)
    return request.param


@pytest.fixture(params=[False, True], ids=["batched", "layerwise"])
def rig(tmp_path, request, via):
    r = Rig(tmp_path, budget_chunks=8, use_layerwise=request.param)
    yield r
    r.close()


class Spy:
    """Records the ``known_keys`` every retrieve gets and counts chunk hashes meanwhile."""

    def __init__(self, rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
        self.known: list[list[bytes]] = []
        self.hashes = 0
        engine = rig.worker.lmcache_engine
        for name in ("retrieve", "retrieve_layerwise"):
            original = getattr(engine, name)

            def spy(*args, _original=original, **kwargs):
                self.known.append(list(kwargs.get("known_keys", ())))
                self.hashes = 0
                return _original(*args, **kwargs)

            monkeypatch.setattr(engine, name, spy)
        digest = lmcache.keys.xxhash.xxh3_128_digest

        def counting(data):
            self.hashes += 1
            return digest(data)

        monkeypatch.setattr(lmcache.keys.xxhash, "xxh3_128_digest", counting)


def _keys(rig: Rig, tokens: list[int], salt: str = "") -> list[bytes]:
    engine = rig.worker.lmcache_engine
    return chunk_keys(tokens, engine._fingerprint, rig.worker.chunk_size, salt="\0" + salt)


def _load(rig: Rig, rid: str, tokens: list[int], **req: object) -> tuple[list[int], torch.Tensor]:
    dst = rig.blocks(PROMPT)
    for c in rig.caches.values():
        c[dst] = float("nan")
    promised = PROMPT - BLOCK
    rig.step(ReqMeta(rid, tokens, dst, load=LoadSpec(0, PROMPT, promised), **req))  # type: ignore[arg-type]
    assert rig.worker.get_block_ids_with_load_errors() == set()
    return dst, rig.pages(dst)[:, : promised // BLOCK]


def test_the_load_reuses_the_lookups_keys(rig, monkeypatch, via):
    tokens = _prompt(1)
    saved = rig.pages(rig.store("writer", tokens)).clone()
    assert rig.scheduler.get_num_new_matched_tokens(_request("r", tokens), 0) == PROMPT - BLOCK
    looked = rig.worker._leases._held["r"].looked_up
    assert looked is not None and list(looked.tokens) == tokens
    assert isinstance(looked.tokens, np.ndarray if via == "socket" else list)
    spy = Spy(rig, monkeypatch)
    _, loaded = _load(rig, "r", tokens[:PROMPT])  # a slice of the prompt, as vLLM's
    hashed = spy.hashes
    if via == "in-process":  # the load's ids are the lookup's int objects: compared, reused
        assert hashed == 0  # nothing hashed again
        assert spy.known == [_keys(rig, tokens)]  # every key, exactly the recomputed ones
    else:  # comparing a decoded array with the metadata's list costs what hashing costs
        assert hashed == len(_keys(rig, tokens)) + 1 and spy.known == [[]]
    assert torch.equal(loaded.view(torch.int32), saved[:, : loaded.shape[1]].view(torch.int32))

    # the metadata pickled to another process: equal ids, other int objects: hashed again
    assert rig.scheduler.get_num_new_matched_tokens(_request("p", tokens), 0) == PROMPT - BLOCK
    _, loaded = _load(rig, "p", pickle.loads(pickle.dumps(tokens)))
    assert spy.known[-1] == [] and spy.hashes == len(_keys(rig, tokens)) + 1
    assert torch.equal(loaded.view(torch.int32), saved[:, : loaded.shape[1]].view(torch.int32))


def test_keys_of_other_tokens_or_salt_are_recomputed(rig, monkeypatch):
    """The scheduler's lookup of request ``r`` saw prompt ``a``; its load carries prompt ``b``
    (same length, other last chunk), or ``a`` with another salt: the lookup's keys are not
    reused, and the load gets ``b``'s KV, not ``a``'s (``b``'s first three chunks are ``a``'s,
    stored from ``a``'s pages: a store skips chunks stored already)."""
    a = _prompt(2)
    b = a[: PROMPT - 10] + [7] * 10
    saved_a = rig.pages(rig.store("wa", a)).clone()
    saved_b = rig.pages(rig.store("wb", b)).clone()
    assert not torch.equal(saved_a, saved_b)
    spy = Spy(rig, monkeypatch)
    rig.scheduler.get_num_new_matched_tokens(_request("r", a), 0)
    _, loaded = _load(rig, "r", b)
    hashed = spy.hashes
    assert spy.known == [[]]  # the tokens differ: nothing is reused
    assert hashed == len(_keys(rig, b)) + 1  # seed + every chunk, hashed again
    shared = 3 * rig.worker.chunk_size // BLOCK  # blocks of the chunks a and b share
    want = torch.cat((saved_a[:, :shared], saved_b[:, shared : loaded.shape[1]]), dim=1)
    assert torch.equal(loaded.view(torch.int32), want.view(torch.int32))

    rig.scheduler.get_num_new_matched_tokens(_request("s", a), 0)
    dst = rig.blocks(PROMPT)
    rig.step(ReqMeta("s", a, dst, load=LoadSpec(0, PROMPT, PROMPT - BLOCK), salt="other"))
    assert spy.known[-1] == []  # another salt: the lookup's keys are not reused
    assert len(rig.worker.get_block_ids_with_load_errors()) == (PROMPT - BLOCK) // BLOCK


def _hit(keys: list[bytes], num_tokens: int) -> HeldHit:
    return HeldHit([], num_tokens) if not keys else _FakeHit(keys, num_tokens)


class _FakeHit(HeldHit):
    def __init__(self, keys: list[bytes], num_tokens: int) -> None:
        super().__init__([], num_tokens)
        self.keys = keys


def _decoded(tokens: list[int]) -> np.ndarray:
    """``tokens`` as a lookup server gets them: through the wire format."""
    a, b = socket.socketpair()
    with a, b:
        a.sendall(encode_lookup(LookupQuery("r", tokens)))
        query = decode_request(b)
    assert query is not None
    return query.tokens  # type: ignore[return-value]


def test_the_wire_carries_token_ids_as_a_read_only_uint32_array() -> None:
    tokens = [0, 1, 2**32 - 1, 70_000]
    got = _decoded(tokens)
    assert got.dtype == np.dtype("<u4") and not got.flags.writeable
    assert got.tolist() == tokens
    assert _decoded([]).tolist() == []
    assert _decoded(np.array(tokens, dtype=np.int64)).tolist() == tokens  # type: ignore[arg-type]
    # the keys of the decoded array are the list's
    assert chunk_keys(got, b"fp", 2) == chunk_keys(tokens, b"fp", 2)
    for bad in ([1, -1], [2**32], np.array([1, -1]), np.array([1.5])):
        with pytest.raises(ValueError, match=r"lookup tokens: token [01] is"):
            encode_lookup(LookupQuery("r", bad))  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["list", "pickled", "decoded"])
@pytest.mark.parametrize("cs", [4, 5])
def test_keys_for_reuses_exactly_the_matching_leading_chunks(cs: int, kind: str) -> None:
    """Against a recompute: the keys offered for a load are always a prefix of the load's own
    chunk keys, for shorter loads, partial last chunks, other tokens, salts and extras; all
    that match are offered when the lookup's ids are the load's int objects (``list``), none
    when comparing would cost what hashing costs (``pickled``, ``decoded``)."""
    prompt = list(range(100_000, 100_023))  # 23 tokens, none a cached small int
    extras = {1: b"img"}
    full = chunk_keys(prompt, b"fp", cs, salt="s", extra_keys=extras)
    source = {
        "list": prompt,
        "pickled": pickle.loads(pickle.dumps(prompt)),
        "decoded": _decoded(prompt),
    }[kind]
    for hit_chunks in range(len(full) + 1):
        hit_tokens = min(hit_chunks * cs, len(prompt))
        hit = _hit(full[:hit_chunks], hit_tokens)
        looked = LookedUp.of(source, "s", extras)
        for n in range(1, len(prompt) + 1):
            for load, salt, extra in [
                (prompt[:n], "s", extras),
                (prompt[:n], "t", extras),
                (prompt[:n], "s", {1: b"other"}),
                (prompt[:n], "s", {}),
                ([*prompt[: n - 1], 9], "s", extras),
            ]:
                extra_n = {i: e for i, e in extra.items() if i * cs < n}
                got = looked.keys_for(hit, load, salt, extra_n, cs)
                want = chunk_keys(load, b"fp", cs, salt=salt, extra_keys=extra_n)
                assert got == want[: len(got)], (hit_chunks, n, salt, extra)
                if (
                    load == prompt[:n]
                    and salt == "s"
                    and extra_n == {i: e for i, e in extras.items() if i * cs < n}
                ):
                    # everything the hit has of the load's chunks, but a partial last one
                    # that ends elsewhere in the prompt
                    reusable = min(hit_chunks, -(-n // cs))
                    if reusable and min(reusable * cs, n) != min(reusable * cs, len(prompt)):
                        reusable -= 1
                    assert len(got) == (reusable if kind == "list" else 0)


def test_keys_for_compares_every_token_not_just_the_sampled_ones() -> None:
    """The load's ids are the lookup's int objects but one, at any position: never reused."""
    prompt = list(range(100_000, 100_064))
    keys = chunk_keys(prompt, b"fp", 8)
    hit = _hit(keys, len(prompt))
    looked = LookedUp.of(prompt, "", {})
    assert looked.keys_for(hit, prompt[:40], "", None, 8) == keys[:5]
    for j in range(40):
        load = prompt[:40]
        load[j] = load[j] + 1
        assert looked.keys_for(hit, load, "", None, 8) == [], j
