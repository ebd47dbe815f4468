# SPDX-License-Identifier: Apache-2.0
"""Tiny random models and their word-level tokenizer, built locally for tests and benchmarks.

:func:`build_tiny_llama` builds a dense Llama; :func:`build_tiny_gemma3` a Gemma-3 text model
(sliding-window and full-attention layers) and :func:`build_tiny_nemotron_h` a Nemotron-H
(Mamba-2, attention and MLP layers), for the hybrid KV caches of engines that serve them.

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
from collections.abc import Callable, Iterator
from typing import Any

__all__ = [
    "FIRST_WORD_ID",
    "SPECIAL_TOKENS",
    "build_tiny_gemma3",
    "build_tiny_llama",
    "build_tiny_nemotron_h",
    "make_prompt",
]

#: Special tokens, in id order: ``<unk>`` = 0, ``<s>`` (bos) = 1, ``</s>`` (eos) = 2, ``<pad>`` = 3.
SPECIAL_TOKENS: tuple[str, ...] = ("<unk>", "<s>", "</s>", "<pad>")
#: Id of the first ordinary word ``w0``; prompts from :func:`make_prompt` use ids from here on.
FIRST_WORD_ID: int = len(SPECIAL_TOKENS)

_MARKER = ".lmcache_tiny_model.json"
_LOCK = ".lmcache_tiny_model.lock"
_FORMAT_VERSION = 1
_TOKEN_IDS: dict[str, Any] = {
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 3,
    "dtype": "bfloat16",
}


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
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
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

    def model() -> Any:
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            max_position_embeddings=max_position_embeddings,
            tie_word_embeddings=False,
            **_TOKEN_IDS,
        )
        return LlamaForCausalLM(cfg)

    return _build(dir, params, model, seed, vocab_size, max_position_embeddings)


def build_tiny_gemma3(
    dir: str | os.PathLike[str],
    *,
    sliding_window: int = 64,
    layer_types: tuple[str, ...] = ("sliding_attention",) * 5 + ("full_attention",),
    hidden_size: int = 256,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    intermediate_size: int = 512,
    vocab_size: int = 1000,
    max_position_embeddings: int = 4096,
    seed: int = 0,
) -> pathlib.Path:
    """Build (or reuse) a random Gemma-3 text model (``Gemma3ForCausalLM``) in ``dir``.

    ``layer_types`` gives each layer's attention, ``"sliding_attention"`` (a window of
    ``sliding_window`` tokens) or ``"full_attention"``; Gemma-3 has 5 sliding layers per full
    one. Files, seeding and reuse as for :func:`build_tiny_llama`.
    """
    params: dict[str, Any] = {
        "format": _FORMAT_VERSION,
        "arch": "gemma3_text",
        "sliding_window": sliding_window,
        "layer_types": list(layer_types),
        "hidden_size": hidden_size,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate_size,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "seed": seed,
    }

    def model() -> Any:
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        cfg = Gemma3TextConfig(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=len(layer_types),
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            query_pre_attn_scalar=head_dim,
            sliding_window=sliding_window,
            layer_types=list(layer_types),
            max_position_embeddings=max_position_embeddings,
            **_TOKEN_IDS,
        )
        return Gemma3ForCausalLM(cfg)

    return _build(dir, params, model, seed, vocab_size, max_position_embeddings)


def build_tiny_nemotron_h(
    dir: str | os.PathLike[str],
    *,
    layers_block_type: tuple[str, ...] = (
        "linear_attention",
        "full_attention",
        "mlp",
        "linear_attention",
    ),
    hidden_size: int = 256,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    mamba_num_heads: int = 8,
    mamba_head_dim: int = 32,
    ssm_state_size: int = 16,
    intermediate_size: int = 512,
    vocab_size: int = 1000,
    max_position_embeddings: int = 4096,
    seed: int = 0,
) -> pathlib.Path:
    """Build (or reuse) a random Nemotron-H model (``NemotronHForCausalLM``) in ``dir``.

    ``layers_block_type`` gives each layer's kind: ``"linear_attention"`` (a Mamba-2 mixer with
    ``mamba_num_heads`` heads of ``mamba_head_dim``, one group, state size
    ``ssm_state_size``), ``"full_attention"`` or ``"mlp"``. Files, seeding and reuse as for
    :func:`build_tiny_llama`. vLLM 0.32's CPU build serves it with its prefix cache off, or in its
    Mamba prefix-caching mode with prefill steps of at most one block.
    """
    params: dict[str, Any] = {
        "format": _FORMAT_VERSION,
        "arch": "nemotron_h",
        "layers_block_type": list(layers_block_type),
        "hidden_size": hidden_size,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "mamba_num_heads": mamba_num_heads,
        "mamba_head_dim": mamba_head_dim,
        "ssm_state_size": ssm_state_size,
        "intermediate_size": intermediate_size,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "seed": seed,
    }

    def model() -> Any:
        from transformers import NemotronHConfig, NemotronHForCausalLM

        cfg = NemotronHConfig(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            layers_block_type=list(layers_block_type),
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            mamba_num_heads=mamba_num_heads,
            mamba_head_dim=mamba_head_dim,
            n_groups=1,
            ssm_state_size=ssm_state_size,
            conv_kernel=4,
            expand=1,
            chunk_size=64,
            max_position_embeddings=max_position_embeddings,
            tie_word_embeddings=False,
            **_TOKEN_IDS,
        )
        return NemotronHForCausalLM(cfg)

    return _build(dir, params, model, seed, vocab_size, max_position_embeddings)


def _build(
    dir: str | os.PathLike[str],
    params: dict[str, Any],
    model: Callable[[], Any],
    seed: int,
    vocab_size: int,
    max_position_embeddings: int,
) -> pathlib.Path:
    """Write ``model()`` (weights drawn from ``seed``, stored bf16), a generation config and
    the tokenizer into ``dir``, unless its marker records ``params`` already."""
    if vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size must exceed the {len(SPECIAL_TOKENS)} special tokens, got {vocab_size}"
        )
    out = pathlib.Path(dir).absolute()
    marker = out / _MARKER
    if _read_marker(marker) == params:
        return out
    out.mkdir(parents=True, exist_ok=True)
    with _locked(out / _LOCK):
        if _read_marker(marker) == params:  # another process built it while we waited
            return out
        marker.unlink(missing_ok=True)

        import torch
        from transformers import GenerationConfig
        from transformers.utils import logging as hf_logging

        # Draw the weights on the CPU in float32 from a private generator state, then store bf16.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            built = model()
        built = built.to(torch.bfloat16)
        built.config.dtype = torch.bfloat16
        progress_was_on = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            built.save_pretrained(str(out), safe_serialization=True)
        finally:
            if progress_was_on:
                hf_logging.enable_progress_bar()
        del built

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
