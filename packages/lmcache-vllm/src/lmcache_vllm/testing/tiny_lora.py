# SPDX-License-Identifier: Apache-2.0
"""A random LoRA adapter in PEFT's on-disk format, built locally for tests.

No adapter can be downloaded where lmcache is tested, so tests write one for the tiny model of
:func:`lmcache_vllm.testing.build_tiny_llama`: ``adapter_config.json`` (``peft_type`` ``LORA``) and
``adapter_model.safetensors`` holding, for every decoder layer ``i`` and target module ``m``::

    base_model.model.model.layers.{i}.self_attn.{m}.lora_A.weight   [rank, in_features]
    base_model.model.model.layers.{i}.self_attn.{m}.lora_B.weight   [out_features, rank]

(``mlp.`` instead of ``self_attn.`` for ``gate_proj``/``up_proj``/``down_proj``), exactly as
``peft`` names them. PEFT initialises ``lora_B`` to zeros (an adapter that changes nothing); here
both factors are random and ``scale`` sets how far the adapter moves each weight, so that a
greedy decode visibly differs from the base model's and from another seed's adapter.

Building is deterministic for its arguments. ``peft`` is not needed: only ``torch`` and
``safetensors``. This module never imports vllm.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Sequence
from typing import Any

__all__ = ["build_random_lora"]

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def _module_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """``module -> (in_features, out_features)`` of a Llama decoder layer described by ``cfg``."""
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    inter = int(cfg["intermediate_size"])
    return {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def build_random_lora(
    folder: str | os.PathLike[str],
    base_model_dir: str | os.PathLike[str],
    *,
    rank: int = 8,
    target_modules: Sequence[str] = _ATTN,
    seed: int = 0,
    scale: float = 1.0,
) -> pathlib.Path:
    """Write a random PEFT LoRA adapter for the Llama checkpoint in ``base_model_dir``.

    Args:
        folder: Where to write ``adapter_config.json`` and ``adapter_model.safetensors``
            (created if missing; existing files are overwritten).
        base_model_dir: A Llama checkpoint folder (its ``config.json`` gives the shapes).
        rank: LoRA rank ``r`` (vLLM needs ``max_lora_rank >= rank``).
        target_modules: Projections to adapt, among ``q_proj k_proj v_proj o_proj gate_proj
            up_proj down_proj``.
        seed: Seed of the random factors; different seeds give different adapters.
        scale: Typical size of an entry of the update ``B @ A`` relative to ``1/sqrt(in)``
            (``lora_alpha = rank``, so vLLM applies ``B @ A`` unscaled). With the tiny model's
            weights (std 0.02) and hidden size 256, ``1.0`` moves the output clearly.

    Returns:
        ``folder`` as an absolute path, ready for ``LoRARequest(name, id, str(folder))``.

    Raises:
        ValueError: ``rank < 1``, no or unknown ``target_modules``.
    """
    import torch
    from safetensors.torch import save_file

    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    modules = list(target_modules)
    if not modules:
        raise ValueError(
            "target_modules is empty; use e.g. ('q_proj', 'k_proj', 'v_proj', 'o_proj')"
        )
    unknown = [m for m in modules if m not in _ATTN + _MLP]
    if unknown:
        raise ValueError(f"unknown target_modules {unknown}; expected some of {list(_ATTN + _MLP)}")
    base = pathlib.Path(base_model_dir).absolute()
    cfg = json.loads((base / "config.json").read_text())
    shapes = _module_shapes(cfg)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(int(cfg["num_hidden_layers"])):
        for module in modules:
            fan_in, fan_out = shapes[module]
            block = "self_attn" if module in _ATTN else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            # (B @ A)[o, i] = sum_k B[o, k] A[k, i]: std scale / sqrt(fan_in).
            a = torch.randn(rank, fan_in, generator=gen) / fan_in**0.5
            b = torch.randn(fan_out, rank, generator=gen) * (scale / rank**0.5)
            tensors[f"{prefix}.lora_A.weight"] = a.contiguous()
            tensors[f"{prefix}.lora_B.weight"] = b.contiguous()
    out = pathlib.Path(folder).absolute()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base),
        "r": rank,
        "lora_alpha": rank,
        "lora_dropout": 0.0,
        "target_modules": modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=1))
    return out
