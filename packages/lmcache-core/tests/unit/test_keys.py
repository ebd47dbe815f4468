# SPDX-License-Identifier: Apache-2.0
"""Chunk keys: published test vectors, determinism across processes, sensitivity, inputs."""

from __future__ import annotations

import multiprocessing
import os
import struct
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest
import torch
import xxhash

from lmcache.keys import (
    EXTRA_MAX_NBYTES,
    EXTRA_TAG,
    KEY_NBYTES,
    KeyChain,
    chunk_keys,
    chunk_ranges,
    key_hex,
)

# Published test vectors of format lmcache-chunk-key-v1:
# (token ids, fingerprint, salt, chunk_size) -> expected key hex per chunk.
# Changing any of these is a cache-format break: bump the format tag instead.
VECTORS: list[tuple[list[int], bytes, str | bytes, int, list[str]]] = [
    (
        [1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
        b"model-a",
        b"",
        4,
        [
            "eb203f3c773c79baf2839c125bf4764f",
            "d47b2826886236db5ce8d59bc5b839b7",
            "45bd8124d962e00adcf42f856f1831d4",
        ],
    ),
    (
        list(range(16)),
        b"",
        "tenant-1",
        8,
        ["c8af877f4fa6a6407cf885fb0467df6d", "fe57109a1efbf73e431b4b77ef0220d1"],
    ),
    (
        [0, 2**32 - 1, 2**31, 65535, 1],
        b'{"format":"lmcache-kv-v1"}',
        "sal\u00e9",
        2,
        [
            "84f8d4eb7e2cbc105a9ffbe0801742f6",
            "0adc9c7aef932e79b84ded5fc727a695",
            "c99d01488e5093b01b1aa56ea8b72169",
        ],
    ),
    ([42] * 5, b"x", b"\x00\xff", 256, ["a6c69d418528ffd45253da35734f10db"]),
]


# Published test vectors with per-chunk extra key material (format lmcache-chunk-key-v1, extras
# tagged b"lmcache-chunk-extra-v1\0"): (token ids, fingerprint, salt, chunk_size, extra_keys) ->
# expected key hex per chunk. The image hashes are sha256(b"image-0") and sha256(b"image-1").
IMAGE_0 = bytes.fromhex("3dd3f8d1db39a536c4f48318eda8e4a804f53fbc2b25b94e3aa98b201be050da")
IMAGE_1 = bytes.fromhex("0cf457e24a479f02fd4d34540389f720f0807dcff92a7562108165b2637ea82f")
EXTRA_VECTORS: list[tuple[list[int], bytes, str | bytes, int, dict[int, bytes], list[str]]] = [
    (
        list(range(10)),
        b"model-a",
        b"",
        4,
        {1: IMAGE_0},
        [
            "c36a172080128aa76655d91eaeda25f0",
            "e07039b4069999678a2a1d26acf450be",
            "d696c57da654fce121e861f9d8dff658",
        ],
    ),
    (
        [7] * 12,
        b'{"format":"lmcache-kv-v1"}',
        "tenant-1",
        4,
        {0: b"\x01", 2: IMAGE_1},
        [
            "a8f5a7a2ce91f6c99398cfdb91f82b8d",
            "de78845d0714eb92833cee356702be37",
            "c43f0d1398542cf357de1dce148346cb",
        ],
    ),
    (
        # VECTORS[0] with a 64-byte extra on its last chunk: the first two keys are unchanged.
        [1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
        b"model-a",
        b"",
        4,
        {2: bytes(range(64))},
        [
            "eb203f3c773c79baf2839c125bf4764f",
            "d47b2826886236db5ce8d59bc5b839b7",
            "eb2c44b7bc317b76b23f97d36db7934c",
        ],
    ),
]


def reference_keys(
    tokens: list[int],
    fingerprint: bytes,
    salt: str | bytes,
    chunk_size: int,
    extras: dict[int, bytes] | None = None,
) -> list[str]:
    """Independent re-implementation: streaming xxh3_128, one struct.pack per token, intdigest."""
    salt_bytes = salt.encode("utf-8") if isinstance(salt, str) else salt
    seed = xxhash.xxh3_128()
    seed.update(b"lmcache-chunk-key-v1")
    seed.update(b"\x00")
    seed.update(fingerprint)
    seed.update(b"\x00")
    seed.update(salt_bytes)
    prev = seed.intdigest().to_bytes(16, "big")
    out = []
    for start in range(0, len(tokens), chunk_size):
        if extras and start // chunk_size in extras:
            h = xxhash.xxh3_128()
            h.update(prev)
            h.update(b"lmcache-chunk-extra-v1")
            h.update(b"\x00")
            h.update(extras[start // chunk_size])
            prev = h.intdigest().to_bytes(16, "big")
        h = xxhash.xxh3_128()
        h.update(prev)
        for token in tokens[start : start + chunk_size]:
            h.update(struct.pack("<I", token))
        prev = h.intdigest().to_bytes(16, "big")
        out.append(prev.hex())
    return out


@pytest.mark.parametrize(("tokens", "fingerprint", "salt", "chunk_size", "expected"), VECTORS)
def test_published_vectors(
    tokens: list[int], fingerprint: bytes, salt: str | bytes, chunk_size: int, expected: list[str]
) -> None:
    assert reference_keys(tokens, fingerprint, salt, chunk_size) == expected
    keys = chunk_keys(tokens, fingerprint, chunk_size, salt=salt)
    assert [key_hex(k) for k in keys] == expected
    assert all(isinstance(k, bytes) and len(k) == KEY_NBYTES for k in keys)


@pytest.mark.parametrize(
    ("tokens", "fingerprint", "salt", "chunk_size", "extras", "expected"), EXTRA_VECTORS
)
def test_published_vectors_with_extras(
    tokens: list[int],
    fingerprint: bytes,
    salt: str | bytes,
    chunk_size: int,
    extras: dict[int, bytes],
    expected: list[str],
) -> None:
    assert EXTRA_TAG == b"lmcache-chunk-extra-v1\x00"
    assert reference_keys(tokens, fingerprint, salt, chunk_size, extras) == expected
    keys = chunk_keys(tokens, fingerprint, chunk_size, salt=salt, extra_keys=extras)
    assert [key_hex(k) for k in keys] == expected
    # Without the extras these are different keys (so the extras are really in the chain).
    plain = chunk_keys(tokens, fingerprint, chunk_size, salt=salt)
    first = min(extras)
    assert keys[:first] == plain[:first]
    assert all(x != y for x, y in zip(keys[first:], plain[first:], strict=True))


def test_extras_change_their_chunk_and_every_later_one() -> None:
    tokens = list(range(100))
    plain = chunk_keys(tokens, b"fp", 16)
    assert chunk_keys(tokens, b"fp", 16, extra_keys={}) == plain
    assert chunk_keys(tokens, b"fp", 16, extra_keys=None) == plain
    with_a = chunk_keys(tokens, b"fp", 16, extra_keys={3: b"image-a"})
    with_b = chunk_keys(tokens, b"fp", 16, extra_keys={3: b"image-b"})
    assert with_a[:3] == plain[:3] == with_b[:3]
    for later in range(3, len(plain)):
        assert len({with_a[later], with_b[later], plain[later]}) == 3
    # An extra on chunk 4 leaves chunk 3 alone; a bytearray counts as its bytes.
    assert chunk_keys(tokens, b"fp", 16, extra_keys={4: b"image-a"})[3] == plain[3]
    assert chunk_keys(tokens, b"fp", 16, extra_keys={3: bytearray(b"image-a")}) == with_a  # type: ignore[dict-item]


def test_extras_match_reference_on_random_inputs() -> None:
    rng = torch.Generator().manual_seed(3)
    for n, chunk in [(1, 1), (257, 256), (1000, 64), (700, 7)]:
        tokens = torch.randint(0, 2**31 - 1, (n,), generator=rng).tolist()
        num_chunks = len(chunk_ranges(n, chunk))
        picks = torch.randint(0, num_chunks, (3,), generator=rng).tolist()
        extras = {i: bytes([i % 256]) * (1 + i % EXTRA_MAX_NBYTES) for i in picks}
        keys = [key_hex(k) for k in chunk_keys(tokens, b"fp", chunk, salt="s", extra_keys=extras)]
        assert keys == reference_keys(tokens, b"fp", "s", chunk, extras)


def test_bad_extra_keys() -> None:
    tokens = list(range(10))  # chunk_size 4: chunks 0, 1, 2
    with pytest.raises(ValueError, match=r"index 3 is not a chunk index.*3 chunk\(s\)"):
        chunk_keys(tokens, b"fp", 4, extra_keys={3: b"x"})
    with pytest.raises(ValueError, match="index -1 is not a chunk index"):
        chunk_keys(tokens, b"fp", 4, extra_keys={-1: b"x"})
    with pytest.raises(ValueError, match=r"index 0 .* 0 chunk\(s\)"):
        chunk_keys([], b"fp", 4, extra_keys={0: b"x"})
    with pytest.raises(TypeError, match="expected an int chunk index"):
        chunk_keys(tokens, b"fp", 4, extra_keys={"1": b"x"})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="expected an int chunk index"):
        chunk_keys(tokens, b"fp", 4, extra_keys={True: b"x"})
    with pytest.raises(TypeError, match=r"extra_keys\[1\] is a str, expected bytes"):
        chunk_keys(tokens, b"fp", 4, extra_keys={1: "abcd"})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=r"extra_keys\[1\] has 0 bytes, expected 1 to 64"):
        chunk_keys(tokens, b"fp", 4, extra_keys={1: b""})
    with pytest.raises(ValueError, match=r"extra_keys\[2\] has 65 bytes"):
        chunk_keys(tokens, b"fp", 4, extra_keys={2: bytes(65)})
    with pytest.raises(TypeError, match="mapping"):
        chunk_keys(tokens, b"fp", 4, extra_keys=[(1, b"x")])  # type: ignore[arg-type]
    assert len(chunk_keys(tokens, b"fp", 4, extra_keys={0: b"x", 2: bytes(64)})) == 3


def test_reference_agrees_on_random_inputs() -> None:
    gen = torch.Generator().manual_seed(0)
    for n, chunk in [(1, 1), (257, 256), (1000, 64), (513, 512)]:
        tokens = torch.randint(0, 2**31 - 1, (n,), generator=gen).tolist()
        keys = [key_hex(k) for k in chunk_keys(tokens, b"fp", chunk, salt="s")]
        assert keys == reference_keys(tokens, b"fp", "s", chunk)


def test_chunk_ranges() -> None:
    assert chunk_ranges(0, 4) == []
    assert chunk_ranges(4, 4) == [(0, 4)]
    assert chunk_ranges(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert chunk_ranges(3, 256) == [(0, 3)]
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_ranges(10, 0)
    with pytest.raises(ValueError, match="num_tokens"):
        chunk_ranges(-1, 4)


def test_one_key_per_chunk_including_partial() -> None:
    assert chunk_keys([], b"fp", 4) == []
    assert len(chunk_keys(list(range(9)), b"fp", 4)) == len(chunk_ranges(9, 4)) == 3


VECTOR_INPUTS = [(tokens, fp, salt, cs) for tokens, fp, salt, cs, _ in VECTORS]


def _hex_all() -> list[list[str]]:
    return [[key_hex(k) for k in chunk_keys(t, f, c, salt=s)] for t, f, s, c in VECTOR_INPUTS]


def test_same_keys_in_spawned_process() -> None:
    tokens = list(range(1000))
    expected = chunk_keys(tokens, b"model-a", 128, salt="t")
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        child = pool.submit(chunk_keys, tokens, b"model-a", 128, salt="t").result(timeout=120)
    assert child == expected


@pytest.mark.parametrize("hashseed", ["0", "12345"])
def test_same_keys_under_other_pythonhashseed(hashseed: str) -> None:
    code = (
        "from lmcache.keys import chunk_keys, key_hex\n"
        f"for t, f, s, c in {VECTOR_INPUTS!r}:\n"
        "    print(','.join(key_hex(k) for k in chunk_keys(t, f, c, salt=s)))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": hashseed}
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    lines = done.stdout.splitlines()
    assert [line.split(",") if line else [] for line in lines] == _hex_all()
    assert [line.split(",") for line in lines] == [v[4] for v in VECTORS]


def test_salt_changes_every_key() -> None:
    tokens = list(range(100))
    base = chunk_keys(tokens, b"fp", 16)
    for salt in ("a", b"a\x00", "tenant-2"):
        other = chunk_keys(tokens, b"fp", 16, salt=salt)
        assert all(x != y for x, y in zip(base, other, strict=True))
    # str salts are their UTF-8 bytes
    assert chunk_keys(tokens, b"fp", 16, salt="sal\u00e9") == chunk_keys(
        tokens, b"fp", 16, salt="sal\u00e9".encode()
    )


def test_fingerprint_changes_every_key() -> None:
    tokens = list(range(100))
    base = chunk_keys(tokens, b"fp-a", 16)
    other = chunk_keys(tokens, b"fp-b", 16)
    assert all(x != y for x, y in zip(base, other, strict=True))
    # The separator keeps (fingerprint, salt) pairs apart: ("a\0", "b") vs ("a", "\0b") differ
    assert chunk_keys(tokens, b"a", 16, salt=b"b") != chunk_keys(tokens, b"a\x00", 16, salt=b"b")


def test_prefix_keys_are_prefix() -> None:
    tokens = list(range(1000, 1300))
    full = chunk_keys(tokens, b"fp", 32)
    for n in (0, 32, 64, 100, 299):
        prefix = chunk_keys(tokens[:n], b"fp", 32)
        full_chunks = n // 32
        assert prefix[:full_chunks] == full[:full_chunks]
        if n % 32:  # a partial last chunk hashes different tokens from the longer sequence
            assert prefix[-1] != full[full_chunks]


def test_keys_depend_on_earlier_chunks() -> None:
    a = chunk_keys([1] * 8 + [5] * 8, b"fp", 8)
    b = chunk_keys([2] * 8 + [5] * 8, b"fp", 8)
    assert a[1] != b[1]


def test_tensor_and_list_agree() -> None:
    tokens = [0, 1, 2**31, 2**32 - 1, 7, 100000, 3]
    expected = chunk_keys(tokens, b"fp", 3)
    for dtype in (torch.int64, torch.uint32):
        assert chunk_keys(torch.tensor(tokens, dtype=dtype), b"fp", 3) == expected
    small = [1, 2, 3, 4, 5]
    for dtype in (torch.int32, torch.int16, torch.uint8):
        assert chunk_keys(torch.tensor(small, dtype=dtype), b"fp", 2) == chunk_keys(small, b"fp", 2)
    assert chunk_keys(tuple(tokens), b"fp", 3) == expected
    # a non-contiguous view hashes its logical elements
    strided = torch.tensor([9, 1, 9, 2, 9, 3])[1::2]
    assert chunk_keys(strided, b"fp", 2) == chunk_keys([1, 2, 3], b"fp", 2)


@pytest.mark.parametrize("bad", [-1, 2**32, 2**40])
def test_out_of_range_token_ids(bad: int) -> None:
    with pytest.raises(ValueError, match=r"token_ids\[2\].*outside \[0, 2\*\*32\)"):
        chunk_keys([1, 2, bad, 4], b"fp", 2)
    with pytest.raises(ValueError, match=r"token_ids\[2\]"):
        chunk_keys(torch.tensor([1, 2, bad, 4], dtype=torch.int64), b"fp", 2)


def test_bad_inputs() -> None:
    with pytest.raises(TypeError, match="int"):
        chunk_keys([1, 2.5], b"fp", 2)  # type: ignore[list-item]
    with pytest.raises(TypeError, match="integer dtype"):
        chunk_keys(torch.tensor([1.0, 2.0]), b"fp", 2)
    with pytest.raises(ValueError, match="1-D"):
        chunk_keys(torch.zeros(2, 2, dtype=torch.int64), b"fp", 2)
    with pytest.raises(TypeError, match="fingerprint"):
        chunk_keys([1], "fp", 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_keys([1], b"fp", 0)


def test_large_input_matches_chunkwise_recompute() -> None:
    tokens = torch.randint(0, 2**31 - 1, (100_000,), generator=torch.Generator().manual_seed(1))
    keys = chunk_keys(tokens, b"fp", 256)
    assert len(keys) == len(chunk_ranges(100_000, 256))
    # every chunk of the chain against the step-by-step reference (a list input to the
    # reference, a tensor to chunk_keys)
    assert [key_hex(k) for k in keys] == reference_keys(tokens.tolist(), b"fp", b"", 256)


# ------------------------------------------------------------------ KeyChain (keys on first use)


def test_key_chain_matches_reference_read_in_any_order() -> None:
    gen = torch.Generator().manual_seed(5)
    for n, chunk in [(0, 4), (1, 1), (257, 256), (1000, 64), (700, 7)]:
        tokens = torch.randint(0, 2**31 - 1, (n,), generator=gen).tolist()
        extras = {
            i: bytes([i % 256]) * (1 + i % 64) for i in range(0, len(chunk_ranges(n, chunk)), 3)
        }
        want = reference_keys(tokens, b"fp", "s", chunk, extras)
        for source in (tokens, torch.tensor(tokens, dtype=torch.int64)):
            chain = KeyChain(source, b"fp", chunk, salt="s", extra_keys=extras)
            assert len(chain) == len(want) and chain.computed() == 0  # len costs nothing
            if want:
                assert key_hex(chain[-1]) == want[-1]  # the last first: every key on the way
                assert chain.computed() == len(want)
            assert [key_hex(k) for k in chain] == want
            fresh = KeyChain(source, b"fp", chunk, salt="s", extra_keys=extras)
            assert [key_hex(k) for k in fresh[1:4]] == want[1:4]
            assert [key_hex(k) for k in fresh[::-2]] == want[::-2]
            assert fresh[5:2] == [] and fresh[:] == chunk_keys(
                source, b"fp", chunk, salt="s", extra_keys=extras
            )


def test_key_chain_hashes_only_what_is_read() -> None:
    tokens = [*range(8), -5, *range(7)]  # chunk_size 4: a bad token in chunk 2
    chain = KeyChain(tokens, b"fp", 4)
    assert chain[0] == chunk_keys(tokens[:4], b"fp", 4)[0]
    assert chain[:2] == chunk_keys(tokens[:8], b"fp", 4)
    assert chain.computed() == 2
    with pytest.raises(ValueError, match=r"token_ids\[8\] = -5 is outside"):
        chain[2]  # the index is the token's position in the request, not in its chunk
    with pytest.raises(TypeError, match=r"token_ids\[9\] = 'x' is a str"):
        KeyChain([0] * 9 + ["x"], b"fp", 4)[:]  # type: ignore[list-item]
    with pytest.raises(IndexError, match="out of range for 4 chunks"):
        chain[4]
    with pytest.raises(IndexError):
        chain[-5]


def test_key_chain_checks_everything_but_token_values_at_once() -> None:
    with pytest.raises(TypeError, match="fingerprint"):
        KeyChain([1], "fp", 2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="salt"):
        KeyChain([1], b"fp", 2, salt=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="chunk_size"):
        KeyChain([1], b"fp", 0)
    with pytest.raises(ValueError, match="1-D"):
        KeyChain(torch.zeros(2, 2, dtype=torch.int64), b"fp", 2)
    with pytest.raises(TypeError, match="integer dtype"):
        KeyChain(torch.tensor([1.0]), b"fp", 2)
    with pytest.raises(ValueError, match="not a chunk index"):
        KeyChain([1, 2, 3], b"fp", 2, extra_keys={2: b"x"})


# ------------------------------------------------------------------ vectorized packing


def _as_inputs(tokens: list[int]) -> list[object]:
    """The same token ids as every accepted input type (lists and tuples packed per run of
    chunks; numpy arrays and torch tensors at once, from several dtypes and layouts)."""
    out: list[object] = [tokens, tuple(tokens), np.array(tokens, dtype=np.int64)]
    out.append(np.array(tokens, dtype=np.uint32))
    out.append(np.array(tokens, dtype=">i8"))  # big-endian: converted, not reinterpreted
    out.append(torch.tensor(tokens, dtype=torch.int64))
    if max(tokens, default=0) < 2**31:
        out.append(torch.tensor(tokens, dtype=torch.int32))
        out.append(np.repeat(np.array(tokens, dtype=np.int64), 2)[::2])  # non-contiguous view
    return out


def test_vectorized_keys_match_reference_on_random_inputs() -> None:
    """Random lengths (partial last chunks included), chunk sizes, salts and extra keys: every
    input type hashes to the per-token reference."""
    rng = np.random.default_rng(11)
    for case in range(40):
        chunk = int(rng.choice([1, 3, 16, 64, 256]))
        n = int(rng.integers(0, 5 * chunk + 2))
        high = 2**32 if case % 3 == 0 else 200_000
        tokens = [int(t) for t in rng.integers(0, high, n, dtype=np.int64)]
        num_chunks = len(chunk_ranges(n, chunk))
        extras = {
            int(i): bytes(rng.integers(0, 256, int(rng.integers(1, 65)), dtype=np.uint8))
            for i in rng.integers(0, max(num_chunks, 1), int(rng.integers(0, 3)))
            if i < num_chunks
        }
        salt: str | bytes = ["", "tenant", b"\x00\xff"][case % 3]
        want = reference_keys(tokens, b"fp", salt, chunk, extras)
        for source in _as_inputs(tokens):
            got = chunk_keys(source, b"fp", chunk, salt=salt, extra_keys=extras)  # type: ignore[arg-type]
            assert [key_hex(k) for k in got] == want, (case, type(source), n, chunk)
            chain = KeyChain(source, b"fp", chunk, salt=salt, extra_keys=extras)  # type: ignore[arg-type]
            assert [key_hex(k) for k in chain] == want


def test_known_keys_continue_the_chain() -> None:
    """Keys passed as ``known`` are used as they are (not recomputed) and the chain goes on
    from the last of them: with the true keys the result is the reference."""
    tokens = list(range(1000, 1000 + 10 * 16 + 5))
    extras = {2: b"image", 7: b"other"}
    want = chunk_keys(tokens, b"fp", 16, salt="s", extra_keys=extras)
    for cut in (0, 1, 3, 11, 20):
        for source in (tokens, np.array(tokens)):
            chain = KeyChain(source, b"fp", 16, salt="s", extra_keys=extras, known=want[:cut])
            assert chain.computed() == min(cut, len(want))
            assert chain[:] == want
    # they are taken on trust: a wrong known key changes every key after it
    fake = [b"\x00" * 16]
    chain = KeyChain(tokens, b"fp", 16, salt="s", extra_keys=extras, known=fake)
    assert chain[0] == fake[0] and all(a != b for a, b in zip(chain[1:], want[1:], strict=True))


@pytest.mark.parametrize("make", [np.array, torch.tensor])
def test_array_inputs_are_checked_at_once(make: object) -> None:
    build = make  # numpy or torch constructor
    with pytest.raises(TypeError, match="integer dtype"):
        KeyChain(build([1.0, 2.0]), b"fp", 2)  # type: ignore[operator]
    with pytest.raises(TypeError, match="integer dtype"):
        KeyChain(build([True, False]), b"fp", 2)  # type: ignore[operator]
    with pytest.raises(ValueError, match=r"1-D \[num_tokens\], found shape \(1, 2\)"):
        KeyChain(build([[1, 2]]), b"fp", 2)  # type: ignore[operator]
    with pytest.raises(ValueError, match="1-D"):
        KeyChain(build(5), b"fp", 2)  # type: ignore[operator]
    # values are checked at construction (a list's only as its chunks are read)
    with pytest.raises(ValueError, match=r"token_ids\[5\] = -3 is outside \[0, 2\*\*32\)"):
        KeyChain(build([1, 2, 3, 4, 5, -3]), b"fp", 2)  # type: ignore[operator]
    with pytest.raises(ValueError, match=r"token_ids\[1\] = 4294967296 is outside"):
        KeyChain(build([1, 2**32, 3]), b"fp", 2)  # type: ignore[operator]
    assert len(KeyChain([1, 2, 3, 4, 5, -3], b"fp", 2)) == 3
    empty = build([], dtype=torch.long if make is torch.tensor else np.int64)  # type: ignore[operator]
    assert chunk_keys(empty, b"fp", 2) == []


def test_array_inputs_are_copied_at_construction() -> None:
    """A lazy chain over an array hashes the values it was built with, not later writes."""
    source = np.arange(64, dtype=np.uint32)
    want = chunk_keys(list(range(64)), b"fp", 8)
    chain = KeyChain(source, b"fp", 8)
    source[:] = 7
    assert chain[:] == want
    tensor = torch.arange(64, dtype=torch.int32)
    chain = KeyChain(tensor, b"fp", 8)
    tensor.fill_(7)
    assert chain[:] == want


def test_list_runs_pack_no_further_than_needed_on_a_bad_token() -> None:
    """A list is packed in growing runs; a bad token beyond the keys read raises nothing."""
    tokens = [*range(4 * 64), -1]  # chunk_size 4: the bad token is in the last chunk (64)
    chain = KeyChain(tokens, b"fp", 4)
    for i in range(64):  # read one key at a time: runs of 1, 1, 2, 4, ... chunks
        assert chain[i] == chunk_keys(tokens[: 4 * (i + 1)], b"fp", 4)[i]
    with pytest.raises(ValueError, match=r"token_ids\[256\] = -1"):
        chain[64]
