# SPDX-License-Identifier: Apache-2.0
"""Configuration, model identity and ranks shared by the SGLang hooks.

Each hook receives its settings its own way (the linker's ``linker_extra_config``, HiCache's
``--hicache-storage-backend-extra-config``, ``--lmcache-config-file``). :func:`hook_config` merges
them with ``LMCACHE_*`` and ``LMCACHE_CONFIG_FILE`` through :func:`lmcache.config.load_config`,
so every hook reports the same typed :class:`~lmcache.config.ConfigError`. :func:`model_facts`
reads what changes the KV bytes from SGLang's ``ServerArgs``; :func:`tp_rank_and_size` the rank.
:func:`log_start_line` logs lmcache's one start-up line per hook and process.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmcache.config import ConfigError, LMCacheConfig, load_config
from lmcache.model_identity import hf_config_dict, model_digest

__all__ = [
    "CONFIG_FILE_KEY",
    "LMCACHE_DAEMON_KEYS",
    "ModelFacts",
    "hook_config",
    "log_start_line",
    "model_facts",
    "strip_daemon_keys",
    "tp_rank_and_size",
]

logger = logging.getLogger(__name__)

CONFIG_FILE_KEY = "config_file"
"""Extra-config key naming an lmcache YAML file (as ``LMCACHE_CONFIG_FILE`` does)."""

LMCACHE_DAEMON_KEYS = frozenset({"mp_host", "mp_port"})
"""Keys of LMCache's multiprocess daemon: accepted and ignored (lmcache runs in process)."""


def log_start_line(hook: str, device: object) -> bool:
    """Log lmcache's start-up line for ``hook`` once in this process
    (:func:`lmcache.banner.log_banner`): packages, SGLang's version, the device of the KV
    lmcache copies and its kernels. SGLang's logging prints it (root handler). Never raises.

    Args:
        hook: The SGLang hook that loaded lmcache (``"UnifiedCacheLinker"``, ...).
        device: The device of the KV this hook copies (``torch.device`` or a string).
    """
    from lmcache.banner import dist_version, log_banner

    sglang = sys.modules.get("sglang")  # imported by SGLang's process; never import it here
    version = getattr(sglang, "__version__", None) or dist_version("sglang")
    return log_banner("SGLang", version, "lmcache-sglang", str(device), hook=hook)


def hook_config(
    extra: Mapping[str, Any] | None,
    *,
    hook: str,
    path: str | None = None,
    ignore: Collection[str] = (),
) -> LMCacheConfig:
    """The lmcache config of one SGLang hook.

    Args:
        extra: The hook's extra config: lmcache keys (optionally ``lmcache.``-prefixed), and
            ``config_file`` naming a YAML file.
        hook: The hook's name, for messages (e.g. ``"linker_extra_config"``).
        path: A YAML file given by the hook itself (``--lmcache-config-file``); ``config_file``
            in ``extra`` wins over it, and either over ``LMCACHE_CONFIG_FILE``.
        ignore: Keys of ``extra`` that belong to SGLang, not to lmcache.

    Raises:
        ConfigError: an unknown key, a wrong type or value (the message names the key, the
            source, the expected form and what was found).
    """
    overrides = dict(extra or {})
    for key in ignore:
        overrides.pop(key, None)
    file_path = overrides.pop(CONFIG_FILE_KEY, None)
    if file_path is not None and not isinstance(file_path, str):
        raise ConfigError(
            f"{hook}[{CONFIG_FILE_KEY!r}]: expected the path of an lmcache YAML file as a "
            f"string, found {type(file_path).__name__} {file_path!r}."
        )
    return load_config(file_path or path, overrides=overrides)


def strip_daemon_keys(raw: Mapping[str, Any], source: str) -> dict[str, Any]:
    """``raw`` without LMCache's daemon keys, logging once that they are not needed."""
    found = sorted(LMCACHE_DAEMON_KEYS & set(raw))
    if found:
        logger.info(
            "lmcache: %s sets %s for LMCache's multiprocess daemon; lmcache runs inside the "
            "SGLang process on its own tiers, so no daemon is needed and these keys are ignored.",
            source,
            ", ".join(found),
        )
    return {k: v for k, v in raw.items() if k not in LMCACHE_DAEMON_KEYS}


@dataclass(frozen=True)
class ModelFacts:
    """What identifies the model's KV bytes besides the pool geometry."""

    model_name: str
    model_revision: str = ""
    quantization: str = ""
    kv_cache_dtype: str = ""
    model_digest: str = ""


def _effective_hf_config(model: str, server_args: object, overrides: Any) -> dict[str, Any] | None:
    """The Hugging Face configuration SGLang builds the model from, as a dict: ``AutoConfig`` of
    ``model`` with ``--json-model-override-args`` applied (as SGLang's ``get_config`` does).

    It is the form vLLM's adapter digests (its ``hf_config.to_dict()``), so that an SGLang and a
    vLLM engine key one model alike. ``None`` when transformers cannot read it."""
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(
            model,
            revision=getattr(server_args, "revision", None),
            trust_remote_code=bool(getattr(server_args, "trust_remote_code", False)),
        )
        if isinstance(overrides, dict) and overrides:
            config.update(overrides)
    except Exception:
        return None
    return hf_config_dict(config)


def _sglang_model_digest(model: str, server_args: object) -> str:
    """:func:`~lmcache.model_identity.model_digest` of SGLang's model: its effective Hugging
    Face configuration (:func:`_effective_hf_config`) and a local folder's weights (or the hub
    snapshot's commit). Where transformers cannot read the configuration, the folder's
    ``config.json`` and the overrides stand for it (keys of their own: not shared with vLLM)."""
    overrides_arg = getattr(server_args, "json_model_override_args", None) or "{}"
    try:
        overrides = json.loads(overrides_arg) if isinstance(overrides_arg, str) else overrides_arg
    except ValueError:
        overrides = str(overrides_arg)
    revision = getattr(server_args, "revision", None)
    effective = _effective_hf_config(model, server_args, overrides)
    if effective is not None:
        return model_digest(model, config=effective, revision=revision)
    config: dict[str, Any] = {"overrides": overrides}
    path = Path(model) / "config.json"
    with contextlib.suppress(OSError, ValueError):  # a hub id: its commit keys it
        config["config.json"] = json.loads(path.read_text())
    return model_digest(model, config=config, revision=revision)


def model_facts(server_args: object) -> ModelFacts:
    """Model path, revision, quantization and KV-cache dtype setting of SGLang's ``ServerArgs``,
    and the digest of its configuration and weights (:func:`_sglang_model_digest`)."""
    model = str(getattr(server_args, "model_path", "") or "")
    if not model:
        raise ConfigError(
            "lmcache-sglang: SGLang's server_args has no model_path; lmcache keys every page "
            "with the model, so it cannot run without one."
        )
    kv_dtype = str(getattr(server_args, "kv_cache_dtype", "auto") or "auto")
    return ModelFacts(
        model_name=model,
        model_revision=str(getattr(server_args, "revision", None) or ""),
        quantization=str(getattr(server_args, "quantization", None) or ""),
        kv_cache_dtype="" if kv_dtype == "auto" else kv_dtype,
        model_digest=_sglang_model_digest(model, server_args),
    )


def tp_rank_and_size(group: Any = None) -> tuple[int, int]:
    """This process's rank and the size of ``group`` (the tensor-parallel cache group)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank(group=group)), int(dist.get_world_size(group=group))
    return 0, 1
