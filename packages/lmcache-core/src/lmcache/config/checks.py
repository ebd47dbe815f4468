# SPDX-License-Identifier: Apache-2.0
"""How one lmcache config value is parsed and checked, whatever source it came from.

:mod:`lmcache.config.loader` finds each value and its source; this module says whether it is valid.
Each check raises :class:`~lmcache.errors.ConfigError` naming the key, the source, the expected
form, what was found and the fix.
The field kinds are ``int``, ``bool``, ``float``, ``str`` and the optional ``str`` and ``bool``.
"""

from __future__ import annotations

import logging
import math
import re
import types
import typing
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from lmcache.errors import ConfigError

__all__ = [
    "LEGACY_NOOP_KEYS",
    "REMOTE_SCHEMES",
    "apply_legacy",
    "check_combination",
    "check_string",
    "check_type",
    "check_value",
    "error",
    "field_kind",
    "mask_url",
]

logger = logging.getLogger("lmcache.config")  # the warnings belong to the config loader

_EXPECTED_FORM = {
    int: "an integer (e.g. 256)",
    bool: "a boolean (true/false, yes/no, 1/0)",
    float: "a finite number (e.g. 5.0)",
    str: "a string",
    "optional_str": "a string, or null/none for unset",
    "optional_bool": "a boolean (true/false, yes/no, 1/0), or null/none for the default",
}

_TRUE = frozenset({"true", "1", "yes"})
_FALSE = frozenset({"false", "0", "no"})
_NONE = frozenset({"none", ""})


def field_kind(tp: Any) -> type | str:
    """The loader kind of a field type: ``int``, ``bool``, ``float``, ``str`` or an optional."""
    if tp in (int, bool, float, str):
        return typing.cast(type, tp)
    if isinstance(tp, types.UnionType) and set(typing.get_args(tp)) == {str, type(None)}:
        return "optional_str"
    if isinstance(tp, types.UnionType) and set(typing.get_args(tp)) == {bool, type(None)}:
        return "optional_bool"
    raise TypeError(
        f"LMCacheConfig field type {tp!r} has no loader; extend lmcache.config.checks.field_kind"
    )


LEGACY_NOOP_KEYS: dict[str, tuple[type, tuple[Any, ...], str]] = {
    # key: (kind, accepted values (empty = any), why it is a no-op)
    "use_experimental": (str, (), "lmcache has a single implementation"),
    "enable_blending": (bool, (False,), "KV blending is not supported; false is the default"),
    "track_usage": (bool, (False,), "lmcache sends no usage data"),
    "remote_serde": (str, (), "chunks are stored raw behind a checksummed header"),
}
"""Keys of the original LMCache config that are accepted and ignored (with a warning)."""

REMOTE_SCHEMES: frozenset[str] = frozenset(
    {"unix"}
    | {
        base + variant
        for base in ("redis", "rediss", "valkey", "valkeys")
        for variant in ("", "+cluster", "+sentinel")
    }
)
"""URL schemes ``remote_url`` accepts (Redis and Valkey, single server, cluster, sentinel)."""


def error(key: str, source: str, expected: str, found: Any, fix: str) -> ConfigError:
    return ConfigError(
        f"Invalid lmcache config key {key!r} (from {source}): expected {expected}, "
        f"found {found!r}. {fix}"
    )


def apply_legacy(key: str, raw: Any, source: str, *, parse_string: bool) -> None:
    """Accept a legacy key of the original LMCache with a warning, or refuse a value it cannot honour."""
    kind, accepted, why = LEGACY_NOOP_KEYS[key]
    value = raw
    if kind is bool:
        value = check_string(key, bool, raw, source) if parse_string else raw
    if accepted and not any(
        value is a or (type(value) is type(a) and value == a) for a in accepted
    ):
        raise error(
            key,
            source,
            " or ".join(repr(a) for a in accepted) + f" (legacy LMCache key: {why})",
            raw,
            "This version cannot do it; remove the key.",
        )
    logger.warning(
        "lmcache config key %r (from %s) is a legacy LMCache setting and is ignored: %s.",
        key,
        source,
        why,
    )


def check_string(key: str, kind: type | str, raw: str, source: str) -> Any:
    """Parse an environment-variable string by the field's kind."""
    text = raw.strip()
    lowered = text.lower()
    if kind is bool or kind == "optional_bool":
        if lowered in _TRUE:
            return True
        if lowered in _FALSE:
            return False
        if kind == "optional_bool" and lowered in _NONE:
            return None
    elif kind is int:
        try:
            return int(text)
        except ValueError:
            pass
    elif kind is float:
        try:
            return float(text)
        except ValueError:
            pass
    elif kind == "optional_str":
        return None if lowered in _NONE else raw
    else:
        return raw
    expected = _EXPECTED_FORM[kind]
    raise error(key, source, expected, raw, f"Set it to {expected}.")


def check_type(key: str, kind: type | str, value: Any, source: str) -> Any:
    """Check a typed value (file, overrides, constructor); returns it (ints widened to float)."""
    ok: bool
    if kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is bool:
        ok = isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if ok:
            value = float(value)
    elif kind == "optional_str":
        ok = value is None or isinstance(value, str)
    elif kind == "optional_bool":
        ok = value is None or isinstance(value, bool)
    else:
        ok = isinstance(value, str)
    if not ok:
        expected = _EXPECTED_FORM[kind]
        raise error(
            key,
            source,
            expected,
            value,
            f"Got a {type(value).__name__}; write it as {expected} (no quotes around numbers or "
            "booleans in YAML/JSON).",
        )
    return value


def check_value(key: str, value: Any, source: str) -> None:
    """Range and form checks on one typed value."""
    if key == "chunk_size" and value <= 0:
        raise error(key, source, "a positive integer (e.g. 256)", value, "Use chunk_size > 0.")
    if key in ("max_local_cpu_size", "max_local_disk_size") and not (
        math.isfinite(value) and value >= 0
    ):
        raise error(key, source, "a finite size in GB >= 0", value, "Use a size such as 5.0.")
    if key == "local_disk" and value is not None and not value.strip():
        raise error(key, source, "a directory path, or null", value, "Give a path or unset it.")
    if key == "remote_url" and value is not None:
        parts = urlsplit(value)
        masked = mask_url(value)
        if not parts.scheme or "://" not in value or not (parts.netloc or parts.path):
            raise error(
                key,
                source,
                "a URL with a scheme and host, e.g. 'redis://localhost:6379'",
                masked,
                "Add the scheme (redis://, valkey://, ...) or unset it.",
            )
        if parts.scheme.lower() not in REMOTE_SCHEMES:
            raise error(
                key,
                source,
                f"a Redis/Valkey URL, scheme one of {sorted(REMOTE_SCHEMES)}",
                masked,
                "lmcache's remote tier is Redis or Valkey; point it at one (redis://host:6379).",
            )
        from lmcache.tiers.redis.url import parse_remote_url

        try:
            parse_remote_url(value)
        except ConfigError as exc:
            raise ConfigError(f"{exc} (from {source})") from None
    if key == "remote_namespace" and not _NAMESPACE.fullmatch(value):
        raise error(
            key, source, "1-64 letters, digits, '_', '.' or '-'", value, "Use e.g. 'lmcache'."
        )
    if key == "remote_timeout" and not (math.isfinite(value) and value > 0):
        raise error(key, source, "a number of seconds > 0", value, "Use e.g. 1.0.")
    if key == "remote_ttl" and not (math.isfinite(value) and value >= 0):
        raise error(key, source, "a number of seconds >= 0 (0: no expiry)", value, "Use 0.")
    if key == "node_cache_dir" and value is not None and not value.startswith("/"):
        raise error(
            key,
            source,
            "an absolute folder path, or null for /dev/shm/lmcache-<uid>",
            value,
            "Give an absolute path (every engine of the node must name the same one).",
        )
    if key == "tier_timeout" and not (math.isfinite(value) and value >= 0):
        raise error(
            key, source, "a number of seconds >= 0 (0: no deadline)", value, "Use e.g. 5.0."
        )


_NAMESPACE = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


def mask_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for messages and logs)."""
    # Imported on use, as parse_remote_url above: importing lmcache.tiers loads torch and the
    # tiers, which a config check does not need.
    from lmcache.tiers.redis.url import mask_url as mask

    return mask(url)


def check_combination(values: Mapping[str, Any], sources: Mapping[str, str]) -> None:
    """Checks across keys."""
    if values["local_cpu"] and values["max_local_cpu_size"] <= 0:
        raise error(
            "max_local_cpu_size",
            sources["max_local_cpu_size"],
            f"a size > 0 GB while local_cpu is true (local_cpu from {sources['local_cpu']})",
            values["max_local_cpu_size"],
            "Give the CPU tier a budget such as 5.0, or set local_cpu to false.",
        )
    if values["local_disk"] is not None and values["max_local_disk_size"] <= 0:
        raise error(
            "max_local_disk_size",
            sources["max_local_disk_size"],
            f"a size > 0 GB while local_disk is set (local_disk from {sources['local_disk']})",
            values["max_local_disk_size"],
            "Give the disk tier a budget such as 50.0, or unset local_disk.",
        )
    if values.get("node_cache") and not values["local_cpu"]:
        raise error(
            "node_cache",
            sources["node_cache"],
            f"false while local_cpu is false (local_cpu from {sources['local_cpu']}): the node "
            "cache is the CPU tier shared by the node's engines",
            True,
            "Set local_cpu to true, or node_cache to false.",
        )
    lower = values["local_disk"] is not None or values["remote_url"] is not None
    if not values["local_cpu"] and lower and values["max_local_cpu_size"] <= 0:
        raise error(
            "max_local_cpu_size",
            sources["max_local_cpu_size"],
            "a size > 0 GB: with local_cpu false it sizes the host buffers that stage transfers "
            "to and from the disk or remote tier",
            values["max_local_cpu_size"],
            "Use e.g. 2.0.",
        )
