# SPDX-License-Identifier: Apache-2.0
"""A tiny random Llama and its word-level tokenizer, built locally for tests and benchmarks.

No model can be downloaded where lmcache is tested, so tests build one: a `transformers.LlamaForCausalLM`
with random weights (bfloat16 safetensors), a word-level tokenizer whose vocabulary is ``<unk> <s> </s>
<pad>`` followed by ``w0 w1 ... wN``, and a generation config. vLLM and SGLang load the folder like any
Hugging Face checkpoint (set ``HF_HUB_OFFLINE=1``). The adapters re-export these names
(``lmcache_vllm.testing``, ``lmcache_sglang.testing``) next to their engine settings.

Building is deterministic for a seed and idempotent: a marker file records the parameters, and a second
call with the same parameters returns at once. A file lock makes concurrent builders (parallel test
workers) safe.

Importing this module imports no engine, nor ``torch``, ``transformers`` or ``tokenizers``: those
are imported when a model is actually built.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pathlib
import random
from collections.abc import Iterator
from typing import Any

__all__ = [
    "FIRST_WORD_ID",
    "SPECIAL_TOKENS",
    "build_tiny_llama",
    "make_prompt",
]

#: Special tokens, in id order: ``<unk>`` = 0, ``<s>`` (bos) = 1, ``</s>`` (eos) = 2, ``<pad>`` = 3.
SPECIAL_TOKENS: tuple[str, ...] = ("<unk>", "<s>", "</s>", "<pad>")
#: Id of the first ordinary word ``w0``; prompts from :func:`make_prompt` use ids from here on.
FIRST_WORD_ID: int = len(SPECIAL_TOKENS)

_MARKER = ".lmcache_tiny_model.json"
_LOCK = ".lmcache_tiny_model.lock"
_FORMAT_VERSION = 1


@contextlib.contextmanager
def _locked(path: pathlib.Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing) for the duration of the block."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _read_marker(path: pathlib.Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _build_tokenizer(out: pathlib.Path, vocab_size: int, max_len: int) -> None:
    """Write a word-level ``PreTrainedTokenizerFast`` with ``vocab_size`` entries into ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab: dict[str, int] = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for i in range(vocab_size - len(SPECIAL_TOKENS)):
        vocab[f"w{i}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # Decoding joins words with single spaces (WordPiece decoder without "##" continuation pieces).
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=max_len,
    )
    fast.save_pretrained(str(out))


def build_tiny_llama(
    dir: str | os.PathLike[str],
    *,
    hidden_size: int = 256,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    intermediate_size: int = 512,
    vocab_size: int = 1000,
    max_position_embeddings: int = 4096,
    seed: int = 0,
) -> pathlib.Path:
    """Build (or reuse) a random Llama checkpoint with a word-level tokenizer in ``dir``.

    Writes ``config.json`` (``dtype`` bfloat16), ``model.safetensors`` (bfloat16 weights drawn from
    ``torch.manual_seed(seed)``), ``generation_config.json`` and the tokenizer files. Returns the folder.
    If ``dir`` already holds a model built with the same parameters, nothing is rebuilt.

    Engines restrict the geometry they serve: for vLLM's CPU attention ``head_dim`` must be one it
    supports (32, 64, 80, 96, 112, 128, ...).
    """
    if vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size must exceed the {len(SPECIAL_TOKENS)} special tokens, got {vocab_size}"
        )
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    out = pathlib.Path(dir).absolute()
    params: dict[str, Any] = {
        "format": _FORMAT_VERSION,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate_size,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "seed": seed,
    }
    marker = out / _MARKER
    if _read_marker(marker) == params:
        return out
    out.mkdir(parents=True, exist_ok=True)
    with _locked(out / _LOCK):
        if _read_marker(marker) == params:  # another process built it while we waited
            return out
        marker.unlink(missing_ok=True)

        import torch
        from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
        from transformers.utils import logging as hf_logging

        cfg = LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            max_position_embeddings=max_position_embeddings,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=3,
            tie_word_embeddings=False,
            dtype="bfloat16",
        )
        # Draw the weights on the CPU in float32 from a private generator state, then store bf16.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = LlamaForCausalLM(cfg)
        model = model.to(torch.bfloat16)
        model.config.dtype = torch.bfloat16
        progress_was_on = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            model.save_pretrained(str(out), safe_serialization=True)
        finally:
            if progress_was_on:
                hf_logging.enable_progress_bar()
        del model

        GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=3).save_pretrained(str(out))
        _build_tokenizer(out, vocab_size, max_position_embeddings)

        tmp = marker.with_suffix(".tmp")
        tmp.write_text(json.dumps(params, indent=1, sort_keys=True))
        tmp.replace(marker)  # the marker is written last: its presence means the folder is complete
    return out


def make_prompt(num_tokens: int, seed: int, *, vocab_size: int = 1000) -> list[int]:
    """Return ``num_tokens`` pseudo-random word token ids (no special tokens), deterministic for ``seed``.

    Use as ``{"prompt_token_ids": make_prompt(...)}``. Ids lie in ``[FIRST_WORD_ID, vocab_size)``.
    """
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    rng = random.Random(seed)
    return [rng.randrange(FIRST_WORD_ID, vocab_size) for _ in range(num_tokens)]
