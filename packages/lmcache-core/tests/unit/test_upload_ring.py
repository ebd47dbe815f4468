# SPDX-License-Identifier: Apache-2.0
"""``UploadRing``: uploads through page-locked buffers allocated once, reused once their last
upload has finished, checked against the host tensors and the backend's recorded calls."""

from __future__ import annotations

import pytest
import torch

from lmcache.devices import UploadRing
from lmcache.testing.recording_backend import RecordingBackend

CPU = torch.device("cpu")


class BusyBackend(RecordingBackend):
    """Events complete only once ``done`` is set (or through ``event_synchronize``)."""

    done = False

    def event_query(self, event: object) -> bool:
        super().event_query(event)
        return self.done


def test_uploads_equal_the_host_tensors_and_reuse_one_buffer() -> None:
    backend = RecordingBackend("cuda")
    ring = UploadRing(backend, CPU, slots=4, min_numel=64)
    g = torch.Generator().manual_seed(0)
    for n in (1, 17, 64, 5, 64):
        host = torch.randint(-(2**62), 2**62, (n,), generator=g, dtype=torch.int64)
        got = ring.upload(host)
        assert torch.equal(got, host)
        host.fill_(7)  # the upload is a copy: later changes to the source do not reach it
        assert not torch.equal(got, host)
    assert [c.detail for c in backend.of("pinned_empty")] == [(64 * 8,)]


def test_shape_is_kept_and_a_bigger_upload_grows_the_buffer() -> None:
    backend = RecordingBackend("cuda")
    ring = UploadRing(backend, CPU, slots=2, min_numel=8)
    host = torch.arange(24, dtype=torch.int64).view(2, 12)
    assert torch.equal(ring.upload(host), host)
    assert [c.detail for c in backend.of("pinned_empty")] == [(24 * 8,)]
    big = torch.arange(100, dtype=torch.int64)
    assert torch.equal(ring.upload(big), big)
    assert [c.detail for c in backend.of("pinned_empty")] == [(24 * 8,), (100 * 8,)]


def test_a_busy_ring_never_waits_and_holds_extra_buffers_until_their_uploads_finish() -> None:
    """The ring grows to its size; past it, uploads take extra buffers instead of waiting for
    the device (the caller is the engine's thread). An extra buffer is kept until its own copy
    has finished, then dropped, never reused while the device may still read it."""
    backend = BusyBackend("cuda")
    ring = UploadRing(backend, CPU, slots=3, min_numel=4)
    hosts = [torch.full((4,), i, dtype=torch.int64) for i in range(5)]
    got = [ring.upload(h) for h in hosts]
    assert all(torch.equal(g, h) for g, h in zip(got, hosts, strict=True))
    assert len(backend.of("pinned_empty")) == 5  # 3 kept, 2 extra
    assert backend.of("event_synchronize") == []  # nobody waited
    extra = [slot[0].data_ptr() for slot in ring._extra]
    kept = [slot[0].data_ptr() for slot in ring._ring]
    assert len(extra) == 2 and not set(extra) & set(kept)
    backend.done = True  # every copy so far has finished
    assert torch.equal(ring.upload(hosts[0]), hosts[0])
    assert ring._extra == []  # dropped once finished
    assert len(backend.of("pinned_empty")) == 5  # a kept buffer served the next upload
    ring.close()
    assert len(backend.of("event_synchronize")) == 3  # close waits for the three kept ones


def test_without_streams_the_upload_is_a_plain_copy() -> None:
    backend = RecordingBackend("cuda", has_streams=False)
    ring = UploadRing(backend, CPU)
    host = torch.arange(5, dtype=torch.int64)
    got = ring.upload(host)
    assert torch.equal(got, host) and got.data_ptr() != host.data_ptr()
    assert backend.of("pinned_empty") == []


def test_bad_input_is_refused() -> None:
    ring = UploadRing(RecordingBackend("cuda"), CPU)
    with pytest.raises(TypeError, match="int64"):
        ring.upload(torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="at least 1 slot"):
        UploadRing(RecordingBackend("cuda"), CPU, slots=0)
