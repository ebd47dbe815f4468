# SPDX-License-Identifier: Apache-2.0
"""The config loader: the frozen :class:`LMCacheConfig` and :func:`load_config`.

:func:`load_config` merges four sources, later ones winning::

    defaults  <  YAML file  <  LMCACHE_<KEY> environment variables  <  overrides dict

* **YAML file** -- the ``path`` argument, else the file named by ``LMCACHE_CONFIG_FILE``. Its top
  level is a mapping of config keys (``chunk_size: 512``), parsed with ``yaml.safe_load``. Values
  must already have the field's type (``chunk_size: "512"`` is an error).
* **Environment** -- ``LMCACHE_CHUNK_SIZE=512``, ``LMCACHE_LOCAL_CPU=false``. Strings are parsed by
  the field's type: integers, finite numbers, booleans (``true/false/1/0/yes/no``, any case), and
  ``none`` or the empty string for ``None`` on optional fields. Other ``LMCACHE_*`` variables are
  errors, except the non-config ones in :data:`NON_CONFIG_ENV_VARS`.
* **Overrides** -- a mapping an adapter builds from the engine's extra config. Keys may carry an
  ``lmcache.`` prefix (``{"lmcache.chunk_size": 512}``), which is stripped. Values must have the
  field's type, as for the file.

Every problem raises :class:`ConfigError`, naming the key, the source it came from (file path, env
var name or overrides key), the expected form and what was found; an unknown key also names the
nearest valid key. The checks of one value live in :mod:`lmcache.config.checks`.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from lmcache.config.checks import (
    LEGACY_NOOP_KEYS,
    apply_legacy,
    check_combination,
    check_string,
    check_type,
    check_value,
    field_kind,
    mask_url,
)
from lmcache.config.checks import REMOTE_SCHEMES as REMOTE_SCHEMES  # it was defined here
from lmcache.errors import ConfigError

__all__ = [
    "CONFIG_FILE_ENV",
    "ENV_PREFIX",
    "NON_CONFIG_ENV_VARS",
    "OVERRIDE_PREFIX",
    "ConfigError",
    "LMCacheConfig",
    "load_config",
]

ENV_PREFIX = "LMCACHE_"
"""Prefix of the environment variables that set config keys (``LMCACHE_CHUNK_SIZE``)."""

CONFIG_FILE_ENV = "LMCACHE_CONFIG_FILE"
"""Environment variable naming the YAML config file when ``load_config`` gets no path."""

OVERRIDE_PREFIX = "lmcache."
"""Optional prefix of override keys (engine extra config), stripped before lookup."""

NON_CONFIG_ENV_VARS: frozenset[str] = frozenset(
    {
        CONFIG_FILE_ENV,
        "LMCACHE_PLUGINS",
        "LMCACHE_PLUGIN_AUTOLOAD",
        "LMCACHE_REQUIRE_CEXT",
        "LMCACHE_DISABLE_CEXT",
        "LMCACHE_JIT",  # build the kernels from their sources on this machine
        "LMCACHE_BUILD_KERNELS",  # setup.py: compile the kernels into the wheel
        "LMCACHE_CUDA_ARCHS",  # setup.py: the architectures compiled in
        "LMCACHE_DISABLE_MEMCPY_BATCH",
        "LMCACHE_LOG_LEVEL",
        "LMCACHE_REMOTE_PASSWORD",
        "LMCACHE_REDIS_SERVER",  # the redis-server binary of lmcache.testing.redis_server
    }
)
"""``LMCACHE_*`` environment variables that belong to lmcache but are not config keys."""


@dataclass(frozen=True)
class LMCacheConfig:
    """Settings of one lmcache instance. Build it with :func:`load_config`.

    Direct construction (``LMCacheConfig(chunk_size=512)``) runs the same type and value checks
    and raises :class:`ConfigError`; ``dataclasses.replace`` does too.
    """

    chunk_size: int = 256
    """Tokens per chunk: the unit of hashing, storage and transfer. Must be > 0."""

    local_cpu: bool = True
    """Keep chunks in the pinned host-memory (CPU) tier."""

    max_local_cpu_size: float = 5.0
    """Byte budget of the CPU tier, in GB (GiB: ``GB * 1024**3`` bytes). Must be > 0 when
    ``local_cpu`` is true."""

    local_disk: str | None = None
    """Folder of the local disk tier (``/path`` or ``file:///path``), or ``None`` for none.
    Chunks there survive an engine restart."""

    max_local_disk_size: float = 0.0
    """Byte budget of the local disk tier, in GB (GiB). Must hold at least one chunk when
    ``local_disk`` is set."""

    remote_url: str | None = None
    """URL of the shared remote tier, or ``None``: ``redis://[user:password@]host:port/db``,
    ``rediss://`` (TLS), ``valkey://``, ``valkeys://``, ``redis+cluster://``,
    ``redis+sentinel://`` (see :mod:`lmcache.tiers.redis.tier`)."""

    remote_namespace: str = "lmcache"
    """Prefix of every key lmcache writes to the remote tier (letters, digits, ``_.-``)."""

    remote_timeout: float = 1.0
    """Seconds one remote operation may take before it counts as a miss. Must be > 0."""

    remote_ttl: float = 0.0
    """Seconds a remote entry lives (Redis ``PX``); 0 keeps entries until evicted by Redis."""

    tier_timeout: float = 5.0
    """Seconds a disk or remote read (a lookup's presence query, or reading chunks into host
    memory) may go without progress before it is abandoned: a miss for that request, counted in
    ``tier_timeouts`` (env ``LMCACHE_TIER_TIMEOUT``). A long read that keeps moving is not cut
    (each chunk read restarts it); after 3 timeouts in a row the tier is skipped for 30 s, then
    probed again. 0 turns the deadline off (reads run on the caller's thread). Must be >= 0."""

    use_layerwise: bool = False
    """Store and load KV layer by layer, overlapping transfers with the forward pass."""

    save_decode_cache: bool = False
    """Also store the KV of tokens produced during decode, not only of the prompt."""

    save_unfull_chunk: bool = False
    """Store a trailing chunk that has fewer than ``chunk_size`` tokens."""

    cache_salt: str = ""
    """Salt mixed into every chunk key: instances with different salts never share chunks."""

    checksum: bool | None = None
    """Store a checksum with every chunk in the CPU tier and verify it before use (a mismatch is
    a miss, or a load error for the chunks it hits). ``None`` (the default) means on for CPU
    engines and for GPU connectors that compute checksums on the device (vLLM's and SGLang's
    CUDA connectors: the store sums each chunk in staging, and each hit is verified once on the
    GPU, in the device copy that is then scattered; ``false`` turns both off).
    It means off for other GPU connectors, where hashing on the host (~9 GB/s a thread) would
    cost more than the PCIe copy it guards. :meth:`checksum_for` resolves it. The disk and
    remote tiers always checksum their chunks, whatever this says."""

    gpu_staging_buffer: bool = True
    """Gather KV into a GPU staging buffer and move it with one DMA copy per transfer."""

    node_cache: bool = False
    """Share one CPU tier among every engine process of the machine (the node cache, see
    ``docs/node_cache.md``): chunks one process stores are hits for the others. The first
    engine starts the node's owner process, whose arena is ``max_local_cpu_size`` (later
    engines use the running owner's). ``false`` (the default) keeps one CPU tier per process.
    Needs ``local_cpu``."""

    node_cache_dir: str | None = None
    """Folder of the node cache (its socket and shared memory file; created with mode 0700).
    ``None``: ``/dev/shm/lmcache-<uid>``, else ``$XDG_RUNTIME_DIR/lmcache``. Engines that share
    chunks must name the same folder."""

    node_cache_autostart: bool = True
    """Start the node cache owner (``python -m lmcache.node serve``) when none answers. ``false``
    when an operator runs it as a service: engines then only connect."""

    def __post_init__(self) -> None:
        source = "LMCacheConfig(...) argument"
        for field in dataclasses.fields(self):
            value = check_type(
                field.name, _FIELD_KINDS[field.name], getattr(self, field.name), source
            )
            check_value(field.name, value, source)
            object.__setattr__(self, field.name, value)
        check_combination(self.to_dict(), dict.fromkeys(_FIELD_KINDS, source))

    def checksum_for(self, device_type: str, on_device: bool = False) -> bool:
        """Whether the CPU tier checksums chunks of an engine whose KV is on ``device_type``
        (``"cpu"``, ``"cuda"``, ...).

        ``checksum`` when set. Otherwise on for ``"cpu"``, and on when the connector computes
        checksums on the device (``on_device``)."""
        if self.checksum is not None:
            return self.checksum
        return device_type == "cpu" or on_device

    @property
    def max_local_cpu_bytes(self) -> int:
        """Byte budget of the CPU tier: ``int(max_local_cpu_size * 1024**3)``."""
        return int(self.max_local_cpu_size * 1024**3)

    def __repr__(self) -> str:
        fields = ", ".join(
            f"{f.name}={v!r}"
            for f in dataclasses.fields(self)
            for v in (getattr(self, f.name),)
            for v in ((mask_url(v) if f.name == "remote_url" and v else v),)
        )
        return f"LMCacheConfig({fields})"

    def to_dict(self) -> dict[str, Any]:
        """Every field as ``{key: value}``; ``load_config(overrides=cfg.to_dict())`` round-trips."""
        return dataclasses.asdict(self)


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> LMCacheConfig:
    """Build a config from defaults, a YAML file, ``LMCACHE_*`` env vars and overrides.

    Args:
        path: YAML file to read. ``None`` reads the file named by ``LMCACHE_CONFIG_FILE`` in
            ``env``, or no file when that is unset or empty.
        env: Environment to read ``LMCACHE_*`` variables from; ``None`` means ``os.environ``.
        overrides: Highest-precedence values, e.g. an engine's extra config. Keys may carry an
            ``lmcache.`` prefix.

    Returns:
        The merged, validated config.

    Raises:
        ConfigError: A key is unknown, a value has the wrong type or a bad value, the file is
            missing or malformed.
    """
    environ: Mapping[str, str] = os.environ if env is None else env
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}

    file_path = os.fspath(path) if path is not None else (environ.get(CONFIG_FILE_ENV) or None)
    if file_path is not None:
        via = "" if path is not None else f" (named by {CONFIG_FILE_ENV})"
        source = f"file {file_path!r}{via}"
        for key, raw in _read_yaml(file_path, source).items():
            _apply(values, sources, key, raw, source, parse_string=False, spell=str)

    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX) or name in NON_CONFIG_ENV_VARS:
            continue
        key = name[len(ENV_PREFIX) :].lower()
        _apply(
            values, sources, key, environ[name], f"env {name}", parse_string=True, spell=_env_name
        )

    seen: dict[str, str] = {}
    for raw_key, raw in (overrides or {}).items():
        if not isinstance(raw_key, str):
            raise ConfigError(
                f"Invalid lmcache overrides key {raw_key!r}: expected a string key such as "
                f"'chunk_size' or 'lmcache.chunk_size', found {type(raw_key).__name__}."
            )
        key = raw_key.removeprefix(OVERRIDE_PREFIX)
        if key in seen:
            raise ConfigError(
                f"lmcache config key {key!r} is given twice in overrides, as {seen[key]!r} and "
                f"{raw_key!r}: keep one of them."
            )
        seen[key] = raw_key
        _apply(values, sources, key, raw, f"overrides[{raw_key!r}]", parse_string=False, spell=str)

    merged = {**_DEFAULTS, **values}
    all_sources = {**dict.fromkeys(_FIELD_KINDS, "defaults"), **sources}
    check_combination(merged, all_sources)
    return LMCacheConfig(**values)


# ---------------------------------------------------------------------------------------------
# Field kinds, parsing and checks
# ---------------------------------------------------------------------------------------------

_FIELD_KINDS: dict[str, type | str] = {
    name: field_kind(tp) for name, tp in typing.get_type_hints(LMCacheConfig).items()
}
_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(LMCacheConfig)}


def _env_name(key: str) -> str:
    return ENV_PREFIX + key.upper()


def _apply(
    values: dict[str, Any],
    sources: dict[str, str],
    key: str,
    raw: Any,
    source: str,
    *,
    parse_string: bool,
    spell: Callable[[str], str],
) -> None:
    """Type-check (or parse) one raw value and record it with its source."""
    if not isinstance(key, str):
        raise ConfigError(
            f"Invalid lmcache config key {key!r} (from {source}): keys must be strings such as "
            f"'chunk_size', found {type(key).__name__}."
        )
    if key in LEGACY_NOOP_KEYS:
        apply_legacy(key, raw, source, parse_string=parse_string)
        return
    if key not in _FIELD_KINDS:
        raise _unknown_key(key, source, spell)
    kind = _FIELD_KINDS[key]
    value = (
        check_string(key, kind, raw, source) if parse_string else check_type(key, kind, raw, source)
    )
    check_value(key, value, source)
    values[key] = value
    sources[key] = source


def _unknown_key(key: str, source: str, spell: Callable[[str], str]) -> ConfigError:
    candidates = {spell(k): k for k in _FIELD_KINDS}
    if spell is _env_name:
        candidates.update({name: name for name in NON_CONFIG_ENV_VARS})
    spelled = spell(key)
    close = difflib.get_close_matches(spelled, list(candidates), n=1, cutoff=0.5)
    hint = f"Did you mean {close[0]!r}? " if close else ""
    valid = ", ".join(spell(k) for k in _FIELD_KINDS)
    return ConfigError(
        f"Unknown lmcache config key {spelled!r} (from {source}). {hint}"
        f"Expected one of: {valid}. Fix the spelling or remove it."
    )


def _read_yaml(file_path: str, source: str) -> dict[Any, Any]:
    """The top-level mapping of a YAML config file (``{}`` for an empty file)."""
    try:
        with open(file_path, encoding="utf-8") as handle:
            loaded = yaml.safe_load(handle)
    except FileNotFoundError as exc:
        raise ConfigError(
            f"lmcache config {source} does not exist: expected a readable YAML file. Fix the "
            f"path, or unset {CONFIG_FILE_ENV} to use defaults and env vars only."
        ) from exc
    except OSError as exc:
        raise ConfigError(f"lmcache config {source} cannot be read: {exc}.") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(
            f"lmcache config {source} is not valid YAML: {exc}. Fix the syntax "
            "(a top-level mapping such as 'chunk_size: 256')."
        ) from exc
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(
            f"lmcache config {source}: expected a top-level mapping of keys such as "
            f"'chunk_size: 256', found a {type(loaded).__name__} ({loaded!r:.80})."
        )
    return loaded
