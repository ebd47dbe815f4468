# SPDX-License-Identifier: Apache-2.0
"""model_identity: the digest that gives a model rebuilt in place, or reconfigured, new keys."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from lmcache import model_identity
from lmcache.model_identity import config_digest, hf_config_dict, model_digest, weights_digest


def _safetensors(path: Path, payload: bytes, header: bytes = b'{"w":{"dtype":"F32"}}') -> None:
    path.write_bytes(len(header).to_bytes(8, "little") + header + payload)


def _model(folder: Path, payload: bytes = b"\1" * 4096) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text('{"hidden_size": 64}')
    _safetensors(folder / "model.safetensors", payload)
    return folder


def _rewrite(path: Path, offset: int, data: bytes) -> None:
    """Change bytes in place (a new mtime, as a rebuild gives)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))


def test_weights_digest_follows_the_bytes_not_the_path_or_times(tmp_path: Path) -> None:
    first = weights_digest(_model(tmp_path / "a"))
    assert len(first) == 32 and weights_digest(tmp_path / "a") == first
    # a copy elsewhere (another machine sharing a Redis tier) has the same digest
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    os.utime(tmp_path / "b" / "model.safetensors", ns=(1, 1))
    assert weights_digest(tmp_path / "b") == first
    # files that are not weights do not count
    (tmp_path / "b" / "README.md").write_text("notes")
    (tmp_path / "b" / "config.json").write_text('{"hidden_size": 65}')
    assert weights_digest(tmp_path / "b") == first
    # one weight byte rewritten in place: another digest (the per-process cache sees the new
    # mtime and hashes again)
    _rewrite(tmp_path / "b" / "model.safetensors", 100, b"\2")
    changed = weights_digest(tmp_path / "b")
    assert changed != first
    # another weight file, or a renamed one, changes it too
    _safetensors(tmp_path / "b" / "extra.safetensors", b"\0" * 16)
    assert weights_digest(tmp_path / "b") not in {first, changed}
    (tmp_path / "b" / "extra.safetensors").rename(tmp_path / "b" / "extra2.safetensors")
    assert weights_digest(tmp_path / "b") not in {first, changed}


def test_folders_without_weights_and_hidden_folders(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    assert weights_digest(tmp_path / "empty") == ""
    base = weights_digest(_model(tmp_path / "m"))
    (tmp_path / "m" / ".cache").mkdir()
    _safetensors(tmp_path / "m" / ".cache" / "tmp.safetensors", b"x")
    assert weights_digest(tmp_path / "m") == base
    (tmp_path / "m" / "sub").mkdir()
    _safetensors(tmp_path / "m" / "sub" / "part.safetensors", b"x")
    assert weights_digest(tmp_path / "m") != base  # weights in subfolders count


def test_large_files_are_sampled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_identity, "FULL_HASH_BYTES", 1 << 20)
    monkeypatch.setattr(model_identity, "SAMPLE_STRIDE", 1 << 20)
    size = 8 << 20
    folder = _model(tmp_path / "big", payload=os.urandom(size))
    weights = folder / "model.safetensors"
    base = weights_digest(folder)
    header_len = 8 + len(b'{"w":{"dtype":"F32"}}')
    # the first and last MiB, and the 4 KiB sample at every stride, are read
    for offset in (header_len + 5, weights.stat().st_size - 3, (3 << 20) + 17):
        _rewrite(weights, offset, b"\xff\x00")
        assert weights_digest(folder) != base, offset
        base = weights_digest(folder)
    # the header is hashed whole: another dtype with the same length changes the digest
    _rewrite(weights, 8 + len(b'{"w":{"dtype":"'), b"I32")
    assert weights_digest(folder) != base
    base = weights_digest(folder)
    # what lies between samples is not read (the documented limit of sampling)
    _rewrite(weights, (3 << 20) + 64 * 1024, b"\xee")
    assert weights_digest(folder) == base


def test_config_digest_ignores_bookkeeping_only() -> None:
    cfg = {"hidden_size": 64, "rope_theta": 10000.0, "rope_scaling": None}
    base = config_digest(cfg)
    noise = {"_name_or_path": "/x", "transformers_version": "4.57", "_commit_hash": "abc"}
    assert config_digest({**cfg, **noise}) == base
    assert config_digest(dict(reversed(list(cfg.items())))) == base
    assert config_digest({**cfg, "rope_theta": 500000.0}) != base
    assert config_digest({**cfg, "rope_scaling": {"type": "linear", "factor": 2.0}}) != base
    assert config_digest({**cfg, "dtype": object()}) == config_digest({**cfg, "dtype": object()})


def test_model_digest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _model(tmp_path / "m")
    cfg = {"hidden_size": 64}
    full = model_digest(str(folder), config=cfg)
    assert full and full == model_digest(str(folder), config=cfg)
    assert model_digest(str(folder), config={"hidden_size": 65}) != full
    assert model_digest(str(folder)) not in {"", full}  # weights only
    # a name that is no folder (and not in a Hugging Face cache): the configuration only
    assert model_digest("no/such-model-here", config=cfg) not in {"", full}
    assert model_digest("no/such-model-here") == ""

    def unreadable(*args: object) -> None:
        raise PermissionError("denied")

    monkeypatch.setattr(model_identity, "_hash_file", unreadable)
    _rewrite(folder / "model.safetensors", 0, b"\0")  # a new state: not cached
    assert model_digest(str(folder), config=cfg) == model_digest("no/such-model-here", config=cfg)


def test_hf_config_dict() -> None:
    class Config:
        def __init__(self, fail: bool = False) -> None:
            self.fail = fail

        def to_dict(self) -> dict[str, object]:
            if self.fail:
                raise RuntimeError("unreadable")
            return {"rope_theta": 10000.0}

    assert hf_config_dict(Config()) == {"rope_theta": 10000.0}
    assert hf_config_dict(Config(fail=True)) is None
    assert hf_config_dict(None) is None and hf_config_dict(object()) is None
