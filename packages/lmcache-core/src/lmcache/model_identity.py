# SPDX-License-Identifier: Apache-2.0
"""What identifies a model's weights and configuration beyond its name: a digest for the keys.

A chunk key covers the model *name* (a path or hub id). The same name can stand for other
weights: a local folder rebuilt or fine-tuned in place, a hub model updated under the same id,
an engine started with configuration overrides (e.g. another RoPE base). Their KV differs for
the same tokens, and a disk or Redis tier would serve the old one after a restart. Adapters fold
:func:`model_digest` into :attr:`lmcache.metadata.LMCacheMetadata.model_digest`, so such a model
gets new keys and never meets the old KV.

What the digest covers:

- ``config``: the engine's effective model configuration (after its overrides), as canonical
  JSON; keys starting with ``_`` and ``transformers_version`` (bookkeeping, not the model) are
  left out.
- a local folder (the name is a directory): every weight file (``*.safetensors``, ``*.bin``,
  ``*.pt``, ``*.pth``, ``*.gguf``, ``*.npz``, ``*.msgpack``, ``*.h5``) by its path relative to the
  folder, its size and its bytes: files up to :data:`FULL_HASH_BYTES` whole; larger ones by a
  sample (a safetensors header whole, the first and last MiB, and 4 KiB every
  :data:`SAMPLE_STRIDE` bytes), so that a folder of many GiB costs milliseconds from the page
  cache. Neither the folder's path nor the files' times enter it: a copy of the folder on another
  machine has the same digest and shares a Redis tier's chunks. A change confined to bytes
  between samples of a large file is not seen (clear the cache after such an edit).
- a hub id whose files are in the local Hugging Face cache: the snapshot's commit hash.

The digest of a folder is cached per process by its files' (name, size, mtime, inode), so
several engines of one model in a process hash it once.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import xxhash

__all__ = [
    "FULL_HASH_BYTES",
    "SAMPLE_STRIDE",
    "config_digest",
    "hf_config_dict",
    "hub_snapshot",
    "model_digest",
    "weights_digest",
]

logger = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".msgpack", ".h5")
"""Files of a model folder whose bytes enter :func:`weights_digest`."""

FULL_HASH_BYTES = 64 << 20
"""Weight files up to this size are hashed whole; larger ones are sampled."""

SAMPLE_STRIDE = 8 << 20
"""Distance between the 4 KiB samples of a large weight file."""

_EDGE = 1 << 20  # the first and last bytes of a large file, hashed whole
_SAMPLE = 4096
_READ = 8 << 20  # read size when hashing a whole file

_cache: dict[tuple[object, ...], str] = {}
_cache_lock = threading.Lock()


def _canonical(value: Any) -> Any:
    """``value`` with mapping keys that are bookkeeping removed, recursively."""
    if isinstance(value, Mapping):
        return {
            str(k): _canonical(v)
            for k, v in value.items()
            if not str(k).startswith("_") and str(k) != "transformers_version"
        }
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    return value


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _plain(value: Any) -> Any:
    """A JSON-able stand-in for ``value``: sets sorted, objects with ``to_dict`` as their
    dict, anything else as its ``str`` without memory addresses (which differ per process)."""
    if isinstance(value, (set, frozenset)):
        return sorted(map(str, value))
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict):
        try:
            return _canonical(to_dict())
        except Exception:
            pass
    return _ADDRESS.sub("", str(value))


def hf_config_dict(hf_config: Any) -> dict[str, Any] | None:
    """An engine's Hugging Face configuration object (``PretrainedConfig``) as the dict
    :func:`model_digest` takes; ``None`` when there is none or it cannot be read."""
    to_dict = getattr(hf_config, "to_dict", None)
    if not callable(to_dict):
        return None
    try:
        value = to_dict()
    except Exception:
        return None
    return dict(value) if isinstance(value, Mapping) else None


def config_digest(config: Mapping[str, Any]) -> str:
    """Hex digest of a model configuration (canonical JSON; see :func:`_plain` for values JSON
    cannot hold)."""
    blob = json.dumps(_canonical(config), sort_keys=True, separators=(",", ":"), default=_plain)
    return xxhash.xxh3_128_hexdigest(blob.encode())


def _weight_files(folder: Path) -> list[Path]:
    files = []
    for path in folder.rglob("*"):
        rel = path.relative_to(folder)
        if any(part.startswith(".") for part in rel.parts):
            continue  # .cache/, .git/ and the like
        if path.suffix in WEIGHT_SUFFIXES and path.is_file():
            files.append(path)
    return sorted(files, key=lambda p: p.relative_to(folder).as_posix())


def _hash_file(hasher: Any, path: Path, size: int) -> None:
    with open(path, "rb") as f:
        fd = f.fileno()
        if size <= FULL_HASH_BYTES:
            while chunk := f.read(_READ):
                hasher.update(chunk)
            return
        if path.suffix == ".safetensors":  # its JSON header: every tensor's name, dtype, shape
            head = os.pread(fd, 8, 0)
            if len(head) == 8:
                n = int.from_bytes(head, "little")
                if 0 < n <= min(size - 8, 512 << 20):
                    hasher.update(os.pread(fd, n, 8))
        hasher.update(os.pread(fd, _EDGE, 0))
        hasher.update(os.pread(fd, _EDGE, size - _EDGE))
        for offset in range(_EDGE, size - _EDGE, SAMPLE_STRIDE):
            hasher.update(os.pread(fd, _SAMPLE, offset))


def weights_digest(folder: str | os.PathLike[str]) -> str:
    """Hex digest of the weight files of a local model folder (see the module docstring);
    ``""`` when the folder holds none.

    Raises:
        OSError: a weight file cannot be read.
    """
    root = Path(folder)
    files = _weight_files(root)
    if not files:
        return ""
    stats = [(p.relative_to(root).as_posix(), p.stat()) for p in files]
    state = (
        str(root.resolve()),
        tuple((rel, st.st_size, st.st_mtime_ns, st.st_ino) for rel, st in stats),
    )
    with _cache_lock:
        cached = _cache.get(state)
    if cached is not None:
        return cached
    hasher = xxhash.xxh3_128()
    for (rel, st), path in zip(stats, files, strict=True):
        hasher.update(f"{rel}\0{st.st_size}\0".encode())
        _hash_file(hasher, path, st.st_size)
    digest = hasher.hexdigest()
    with _cache_lock:
        _cache[state] = digest
    return digest


def hub_snapshot(
    repo_id: str, filename: str = "config.json", revision: str | None = None
) -> Path | None:
    """The folder of ``repo_id``'s snapshot in the local Hugging Face cache that holds
    ``filename`` (``revision``: a branch, tag or commit; ``None``: ``main``), else ``None``.

    Only the cache on disk is read (never the network); ``None`` for anything that is not a
    hub id (``org/name``), when ``huggingface_hub`` is not installed, or when the file is not
    cached.
    """
    if repo_id.count("/") != 1 or repo_id.startswith((".", "/", "~")):
        return None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(repo_id, filename, revision=revision)
    except Exception:  # a malformed id: nothing to find
        return None
    if not isinstance(found, str):
        return None
    snapshot = Path(found).parent
    return snapshot if snapshot.parent.name == "snapshots" else None


def model_digest(
    model: str,
    *,
    config: Mapping[str, Any] | None = None,
    revision: str | None = None,
) -> str:
    """Digest of what the name ``model`` stands for: its configuration (``config``, the
    engine's effective one) and its weights (a local folder's files, or a hub snapshot's commit
    hash); ``""`` when nothing is known. Weights that cannot be read leave them out (logged):
    the name, revision and configuration still key the model.
    """
    parts = []
    if config is not None:
        parts.append("config:" + config_digest(config))
    path = Path(model)
    try:
        if path.is_dir():
            weights = weights_digest(path)
            if weights:
                parts.append("weights:" + weights)
        else:
            snapshot = hub_snapshot(model, "config.json", revision)
            if snapshot is not None:  # its folder is named by the commit hash
                parts.append("hub:" + snapshot.name)
    except OSError as e:
        logger.warning(
            "lmcache: cannot read the weights of %s for its cache keys (%s); keys cover its "
            "name, revision and configuration only",
            model,
            e,
        )
    if not parts:
        return ""
    return xxhash.xxh3_128_hexdigest("\n".join(parts).encode())
