# SPDX-License-Identifier: Apache-2.0
"""What of a vLLM request, besides its token ids, goes into lmcache's chunk keys.

The same token ids do not always mean the same KV. vLLM's own prefix cache separates requests by
cache salt, LoRA adapter, multimodal inputs and prompt embeddings; lmcache must separate them
too, or it serves one request's KV to another (a wrong answer). :class:`RequestKeyer` turns a
vLLM ``Request`` into a :class:`RequestKey`:

- ``salt``: ``""`` for a plain request; otherwise the hex xxh3-128 of the request's
  ``cache_salt`` and LoRA adapter identity (name, path, base model and a digest of the
  adapter's files, found as vLLM finds them: a local folder, or a hub id's snapshot in the
  local Hugging Face cache). It seeds every chunk key of the request, so any salt length costs
  32 characters on the wire.
- ``extra_keys``: chunk index -> 16 bytes for each chunk that holds the first placeholder token
  of a multimodal item (image, audio, video), folded from the items' content hashes
  (``MultiModalFeatureSpec.identifier``) and placeholder positions. The key chain carries them
  into every later chunk; chunks before the first item are shared with text-only requests.
- ``skip_reason``: set when a request's KV depends on inputs that cannot be keyed safely
  (prompt embeddings, no token ids, a LoRA adapter whose files are not found here, e.g. a hub
  adapter's first request, before vLLM downloaded it). The connector then neither stores nor
  loads the request.

This module never imports vLLM: requests are read by attribute.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import xxhash

from lmcache.model_identity import hub_snapshot

if TYPE_CHECKING:
    from lmcache_vllm.vllm_types import SchedulerRequest

__all__ = [
    "ADAPTER_FILES",
    "RequestKey",
    "RequestKeyer",
    "adapter_folder",
    "chunk_extra_keys",
    "skips_reading",
]

logger = logging.getLogger(__name__)

ADAPTER_FILES = (
    "adapter_config.json",
    "adapter_model.safetensors",
    "adapter_model.bin",
    "adapter_model.pt",
)
"""Files of a local LoRA adapter folder whose bytes enter the adapter's digest."""


@dataclass(frozen=True)
class RequestKey:
    """Key material of one request (see the module docstring)."""

    salt: str = ""
    extra_keys: dict[int, bytes] = field(default_factory=dict)
    skip_reason: str | None = None


class RequestKeyer:
    """Derives :class:`RequestKey` objects; caches LoRA adapter digests by file state.

    Args:
        chunk_size: Tokens per chunk (places multimodal items in chunks).
    """

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size
        self._adapter_digests: dict[tuple[str, tuple[tuple[str, int, int], ...]], str] = {}

    def key(self, request: SchedulerRequest) -> RequestKey:
        """Key material of ``request`` (a vLLM ``Request`` or anything with its attributes).

        Raises:
            Exception: whatever reading a malformed request raises; callers turn it into a
                miss.
        """
        if getattr(request, "prompt_embeds", None) is not None:
            return RequestKey(skip_reason="prompt embeddings cannot be keyed")
        if getattr(request, "prompt_token_ids", None) is None:
            return RequestKey(skip_reason="request has no prompt token ids")
        parts: list[str] = []
        salt = getattr(request, "cache_salt", None)
        if salt:
            parts += ["salt", str(salt)]
        lora = getattr(request, "lora_request", None)
        if lora is not None:
            identity = self._lora_identity(lora)
            if identity is None:
                return RequestKey(
                    skip_reason=f"LoRA adapter {getattr(lora, 'lora_name', '?')!r}: no local "
                    "folder with its files (yet), so its KV cannot be keyed by content"
                )
            parts += ["lora", *identity]
        key_salt = ""
        if parts:
            blob = json.dumps(parts, ensure_ascii=False).encode("utf-8", "surrogatepass")
            key_salt = xxhash.xxh3_128_hexdigest(blob)
        features = getattr(request, "mm_features", None) or []
        return RequestKey(salt=key_salt, extra_keys=self._mm_extra_keys(features))

    # ------------------------------------------------------------------ LoRA

    def _lora_identity(self, lora: Any) -> list[str] | None:
        """Name, path, base model and content digest of ``lora``; ``None`` when its files are
        not found here (its content cannot be keyed)."""
        name = str(getattr(lora, "lora_name", "") or "")
        path = str(getattr(lora, "lora_path", "") or "")
        base = str(getattr(lora, "base_model_name", "") or "")
        folder = adapter_folder(path)
        if folder is None:
            return None
        return [name, path, base, self._adapter_digest(folder)]

    def _adapter_digest(self, folder: Path) -> str:
        """xxh3-128 of the adapter folder's files (:data:`ADAPTER_FILES`).

        Cached by (folder, file names, sizes, mtimes), so an adapter rewritten in place under
        the same name gets a new digest and never meets its old KV.
        """
        state = tuple(
            (name, st.st_size, st.st_mtime_ns)
            for name in ADAPTER_FILES
            if (st := _stat(folder / name)) is not None
        )
        cache_key = (str(folder.resolve()), state)
        digest = self._adapter_digests.get(cache_key)
        if digest is None:
            hasher = xxhash.xxh3_128()
            for name, _, _ in state:
                hasher.update(name.encode() + b"\0")
                with open(folder / name, "rb") as f:
                    while block := f.read(1 << 22):
                        hasher.update(block)
            digest = hasher.hexdigest()
            self._adapter_digests[cache_key] = digest
        return digest

    # ------------------------------------------------------------------ multimodal

    def _mm_extra_keys(self, features: Iterable[Any]) -> dict[int, bytes]:
        per_chunk: dict[int, list[bytes]] = {}
        for feature in features:
            identifier = getattr(feature, "identifier", None) or getattr(feature, "mm_hash", None)
            position = getattr(feature, "mm_position", None)
            if identifier is None or position is None:
                raise ValueError(
                    f"multimodal feature {feature!r} has no identifier or mm_position; "
                    "its KV cannot be keyed"
                )
            offset, length = int(position.offset), int(position.length)
            if offset < 0 or length < 0:
                raise ValueError(f"multimodal placeholder at offset {offset} length {length}")
            modality = str(getattr(feature, "modality", ""))
            item = json.dumps([modality, str(identifier), offset, length]).encode()
            per_chunk.setdefault(offset // self.chunk_size, []).append(item)
        return {
            chunk: xxhash.xxh3_128_digest(b"\0".join(sorted(items)))
            for chunk, items in per_chunk.items()
        }


def adapter_folder(path: str) -> Path | None:
    """The local folder of a LoRA adapter named by ``path``, resolved as vLLM's
    ``get_adapter_absolute_path`` does (a folder, ``~`` expanded; else a hub id's snapshot, here
    only from the local Hugging Face cache), or ``None`` when no folder with an
    ``adapter_config.json`` is found (never downloads)."""
    if not path:
        return None
    folder = Path(os.path.expanduser(path))
    if folder.is_dir():
        return folder if (folder / "adapter_config.json").is_file() else None
    if folder.exists() or folder.is_absolute():
        return None
    return hub_snapshot(path, "adapter_config.json")


def _stat(path: Path) -> os.stat_result | None:
    try:
        return path.stat()
    except OSError:
        return None


def skips_reading(request: SchedulerRequest) -> bool:
    """Whether vLLM must compute every prompt token of ``request`` itself: it asks for prompt
    logprobs, or sets ``skip_reading_prefix_cache`` (vLLM's own prefix cache skips such requests;
    vLLM 0.32 also drops a connector's hit for them, 0.26 would take it)."""
    skip = getattr(request, "skip_reading_prefix_cache", None)
    if isinstance(skip, bool):
        return skip
    params = getattr(request, "sampling_params", None)
    return params is not None and getattr(params, "prompt_logprobs", None) is not None


def chunk_extra_keys(
    extra_keys: dict[int, bytes], num_tokens: int, chunk_size: int
) -> dict[int, bytes]:
    """The extra keys of the chunks that ``num_tokens`` tokens cover."""
    if not extra_keys:
        return {}
    chunks = -(-num_tokens // chunk_size)
    return {i: e for i, e in extra_keys.items() if i < chunks}
