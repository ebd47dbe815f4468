# SPDX-License-Identifier: Apache-2.0
"""Conformance suite every GPU connector runs (langchain standard-tests style).

An adapter subclasses :class:`GPUConnectorConformance` in a test module, in a class whose name
starts with ``Test``, and supplies its layout through four methods::

    import pytest
    import torch
    from lmcache.gpu_connector import EngineInfo
    from lmcache.gpu_connector.registry import register_gpu_connector
    from lmcache.testing.conformance import GPUConnectorConformance, default_metadata_cases

    class TestVllmCpuConformance(GPUConnectorConformance):
        def metadata_cases(self):                       # optional; default: default_metadata_cases()
            return [m for m in default_metadata_cases() if m.head_size_k == m.head_size_v]

        def make_engine(self, metadata):                # random KV in the layout under test
            ...                                         # >= self.required_slots(metadata) slots
            return EngineInfo(name="vllm", device="cpu", kv_caches=[...], extra={...})

        def valid_slots(self, engine):                  # slots the suite may use, [num_slots] int64
            return torch.arange(32, 32 * num_blocks)    # e.g. skip vLLM's null block 0

        def read_token_kv(self, engine, slots):         # the oracle: an independent reader
            ...                                         # -> [num_layers, num_tokens, kv_width]

        # optional: connector_factory (default CreateGPUConnector; set it to a property or a
        # staticmethod), make_config(metadata), layout_hints(metadata), engine_device(engine).

With the default factory, the adapter's key must be registered (its entry point, once the
adapter is installed, or ``register_gpu_connector`` in a fixture). Each test is parametrized over
``metadata_cases()`` and seeded, so failures reproduce. ``make_engine`` must draw its random
contents from torch's global RNG (the suite seeds it) so that two calls after the same seed give
identical engines.

Overriding a suite test is allowed only to mark a known gap: the override must carry
``@pytest.mark.xfail(reason="...")`` (the class definition raises ``TypeError`` otherwise)::

    @pytest.mark.xfail(reason="layerwise load of partial pages lands in vLLM 0.34", strict=True)
    def test_layerwise_round_trip_equals_batched(self, kv_case):
        super().test_layerwise_round_trip_equals_batched(kv_case)
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from lmcache.config import LMCacheConfig
from lmcache.gpu_connector.interface import (
    ChunkTransfer,
    EngineInfo,
    GPUConnectorInterface,
    SupportsLayerwise,
    TransferSpec,
    supports_layerwise,
)
from lmcache.gpu_connector.registry import CreateGPUConnector
from lmcache.memory.pinned_pool import HostMemoryPool
from lmcache.metadata import LMCacheMetadata

__all__ = ["ConnectorFactory", "GPUConnectorConformance", "default_metadata_cases"]

ConnectorFactory = Callable[
    [LMCacheConfig, LMCacheMetadata, EngineInfo, "Mapping[str, Any] | None"], GPUConnectorInterface
]


def default_metadata_cases() -> list[LMCacheMetadata]:
    """Small geometries: fp32/fp16/bf16, 1-4 heads, equal and unequal K/V head sizes, MLA."""
    common: dict[str, Any] = {
        "model_name": "conformance",
        "world_size": 1,
        "worker_id": 0,
        "local_worker_id": 0,
        "local_world_size": 1,
        "num_layers": 3,
        "chunk_size": 8,
    }
    return [
        LMCacheMetadata(
            kv_dtype=torch.float32, num_kv_heads=2, head_size_k=8, head_size_v=8, **common
        ),
        LMCacheMetadata(
            kv_dtype=torch.bfloat16, num_kv_heads=4, head_size_k=4, head_size_v=4, **common
        ),
        LMCacheMetadata(
            kv_dtype=torch.float16, num_kv_heads=2, head_size_k=8, head_size_v=4, **common
        ),
        LMCacheMetadata(
            kv_dtype=torch.bfloat16,
            num_kv_heads=1,
            head_size_k=24,
            head_size_v=0,
            use_mla=True,
            **common,
        ),
    ]


def _case_id(m: LMCacheMetadata) -> str:
    dtype = str(m.kv_dtype).removeprefix("torch.")
    if m.use_mla:
        return f"{dtype}-mla{m.head_size_k}"
    return f"{dtype}-h{m.num_kv_heads}-k{m.head_size_k}-v{m.head_size_v}"


@dataclass(frozen=True)
class _Scenario:
    """A request of ``num_chunks_total`` chunk slots; chunks ``first..`` are transferred."""

    name: str
    full_chunks: int
    tail_tokens: int
    first_chunk: int

    def num_tokens(self, chunk_size: int) -> int:
        return self.full_chunks * chunk_size + self.tail_tokens

    def ranges(self, chunk_size: int) -> list[tuple[int, int]]:
        n = self.num_tokens(chunk_size)
        starts = range(self.first_chunk * chunk_size, n, chunk_size)
        return [(s, min(s + chunk_size, n)) for s in starts]


_SCENARIOS = [
    _Scenario("full-chunks", 3, 0, 0),
    _Scenario("partial-last", 2, 3, 0),
    _Scenario("suffix-after-hit", 3, 0, 1),
    _Scenario("one-token-tail", 1, 1, 0),
]
_MAX_CHUNKS = 3  # the longest scenario spans 3 chunks


def _seed(*parts: object) -> None:
    torch.manual_seed(zlib.crc32(repr(parts).encode()))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous().view(torch.uint8)


def _assert_bit_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (
        f"{what}: expected {list(expected.shape)} {expected.dtype}, "
        f"found {list(actual.shape)} {actual.dtype}"
    )
    if not torch.equal(_bits(actual), _bits(expected)):
        a, e = actual.detach().cpu(), expected.detach().cpu()
        bad = (a != e).reshape(a.shape[0], a.shape[1], -1).any(dim=-1).any(dim=0)
        raise AssertionError(
            f"{what}: bytes differ for {int(bad.sum())} of {a.shape[1]} tokens "
            f"(first token indices: {bad.nonzero().flatten()[:8].tolist()})"
        )


class GPUConnectorConformance:
    """Base class of the connector conformance suite (not collected itself: no ``Test`` prefix).

    See the module docstring for what a subclass supplies.
    """

    # ----------------------------------------------------------------- adapter-supplied
    def make_engine(self, metadata: LMCacheMetadata) -> EngineInfo:
        """Build an engine with random KV in the layout under test (global torch RNG)."""
        raise NotImplementedError(f"{type(self).__name__} must implement make_engine(metadata)")

    def valid_slots(self, engine: EngineInfo) -> torch.Tensor:
        """``[num_slots]`` int64: the engine slots the suite may read and write."""
        raise NotImplementedError(f"{type(self).__name__} must implement valid_slots(engine)")

    def read_token_kv(self, engine: EngineInfo, slots: torch.Tensor) -> torch.Tensor:
        """Oracle reader: ``[num_layers, num_tokens, kv_width]`` canonical rows of ``slots``."""
        raise NotImplementedError(f"{type(self).__name__} must implement read_token_kv()")

    def metadata_cases(self) -> Sequence[LMCacheMetadata]:
        """Geometries to run every test with (default: :func:`default_metadata_cases`)."""
        return default_metadata_cases()

    @property
    def connector_factory(self) -> ConnectorFactory:
        """``(config, metadata, engine, layout_hints) -> connector``; default CreateGPUConnector."""
        return CreateGPUConnector

    def make_config(self, metadata: LMCacheMetadata) -> LMCacheConfig:
        """Cache configuration the connector is built with."""
        return LMCacheConfig(chunk_size=metadata.chunk_size)

    def layout_hints(self, metadata: LMCacheMetadata) -> Mapping[str, Any] | None:
        """Layout hints passed to the factory."""
        return None

    def engine_device(self, engine: EngineInfo) -> torch.device:
        """Device for the slot mapping (default: the device of the first KV tensor)."""
        first = engine.kv_caches[0]
        while isinstance(first, (tuple, list)):
            first = first[0]
        return first.device if isinstance(first, torch.Tensor) else torch.device("cpu")

    def required_slots(self, metadata: LMCacheMetadata) -> int:
        """Valid slots ``make_engine`` must provide (the longest request plus a spare chunk)."""
        return (_MAX_CHUNKS + 1) * metadata.chunk_size

    # ----------------------------------------------------------------- pytest plumbing
    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name, value in vars(cls).items():
            if not (name.startswith("test_") and name in _SUITE_TESTS):
                continue
            marks = getattr(value, "pytestmark", [])
            if not any(m.name == "xfail" and m.kwargs.get("reason") for m in marks):
                raise TypeError(
                    f"{cls.__name__}.{name} overrides a conformance test without "
                    "@pytest.mark.xfail(reason=...); fix the connector, or mark the known gap "
                    "with xfail and a reason."
                )

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "kv_case" in metafunc.fixturenames:
            cases = list(self.metadata_cases())
            metafunc.parametrize("kv_case", cases, ids=[_case_id(m) for m in cases])
        if "scenario" in metafunc.fixturenames:
            metafunc.parametrize("scenario", _SCENARIOS, ids=[s.name for s in _SCENARIOS])

    # ----------------------------------------------------------------- helpers
    def _connector(self, metadata: LMCacheMetadata, engine: EngineInfo) -> GPUConnectorInterface:
        connector = self.connector_factory(
            self.make_config(metadata), metadata, engine, self.layout_hints(metadata)
        )
        assert connector.num_layers == metadata.num_layers
        assert connector.kv_width == metadata.kv_width
        assert connector.dtype == metadata.kv_dtype
        return connector

    def _engine(self, metadata: LMCacheMetadata, *seed: object) -> EngineInfo:
        _seed(type(self).__name__, _case_id(metadata), *seed)
        engine = self.make_engine(metadata)
        have = len(self.valid_slots(engine))
        if have < self.required_slots(metadata):
            raise AssertionError(
                f"make_engine gave {have} valid slots; the suite needs at least "
                f"required_slots(metadata)={self.required_slots(metadata)}."
            )
        return engine

    def _snapshot(self, engine: EngineInfo) -> torch.Tensor:
        return self.read_token_kv(engine, self.valid_slots(engine)).detach().cpu().clone()

    def _random_positions(self, engine: EngineInfo, n: int) -> torch.Tensor:
        return torch.randperm(len(self.valid_slots(engine)))[:n]

    def _spec(
        self, engine: EngineInfo, positions: torch.Tensor, skip_tokens: int = 0
    ) -> TransferSpec:
        slots = self.valid_slots(engine).cpu()[positions].to(torch.long)
        return TransferSpec(slots.to(self.engine_device(engine)), skip_tokens=skip_tokens)

    @contextlib.contextmanager
    def _leased_chunks(
        self, connector: GPUConnectorInterface, ranges: Sequence[tuple[int, int]]
    ) -> Iterator[list[ChunkTransfer]]:
        total = sum(connector.chunk_nbytes(e - s) for s, e in ranges)
        pool = HostMemoryPool(total + (len(ranges) + 1) * 4096, slab_bytes=1 << 20)
        with contextlib.ExitStack() as stack:
            chunks = []
            for start, end in ranges:
                lease = pool.allocate(connector.chunk_shape(end - start), connector.dtype)
                assert lease is not None, "HostMemoryPool could not lease a chunk buffer"
                stack.enter_context(lease)
                lease.tensor.fill_(0)
                chunks.append(ChunkTransfer(start, end, lease.tensor))
            yield chunks

    def _oracle(self, engine: EngineInfo, spec: TransferSpec, start: int, end: int) -> torch.Tensor:
        return self.read_token_kv(engine, spec.slot_mapping[start:end]).detach().cpu()

    # ----------------------------------------------------------------- the tests
    def test_from_gpu_matches_oracle(self, kv_case: LMCacheMetadata, scenario: _Scenario) -> None:
        engine = self._engine(kv_case, "a", scenario.name)
        connector = self._connector(kv_case, engine)
        cs = kv_case.chunk_size
        spec = self._spec(engine, self._random_positions(engine, scenario.num_tokens(cs)))
        before = self._snapshot(engine)
        with self._leased_chunks(connector, scenario.ranges(cs)) as chunks:
            connector.from_gpu(chunks, spec)
            for chunk in chunks:
                expected = self._oracle(engine, spec, chunk.start, chunk.end)
                _assert_bit_equal(
                    chunk.buffer, expected, f"from_gpu chunk [{chunk.start}, {chunk.end})"
                )
        _assert_bit_equal(self._snapshot(engine), before, "engine cache after from_gpu")
        connector.close()

    def test_round_trip_bit_exact(self, kv_case: LMCacheMetadata, scenario: _Scenario) -> None:
        cs = kv_case.chunk_size
        n = scenario.num_tokens(cs)
        engine_a = self._engine(kv_case, "a", scenario.name)
        spec_a = self._spec(engine_a, self._random_positions(engine_a, n))
        engine_b = self._engine(kv_case, "b", scenario.name)  # different random KV: poison
        pos_b = self._random_positions(engine_b, n)
        spec_b = self._spec(engine_b, pos_b)
        expected_b = self._snapshot(engine_b)
        conn_a = self._connector(kv_case, engine_a)
        conn_b = self._connector(kv_case, engine_b)
        with self._leased_chunks(conn_a, scenario.ranges(cs)) as chunks:
            conn_a.from_gpu(chunks, spec_a)
            conn_b.to_gpu(chunks, spec_b)
            conn_b.synchronize()
        for start, end in scenario.ranges(cs):
            expected_b[:, pos_b[start:end]] = self._oracle(engine_a, spec_a, start, end)
        _assert_bit_equal(self._snapshot(engine_b), expected_b, "engine B after store A -> load B")
        conn_a.close()
        conn_b.close()

    @pytest.mark.parametrize("skip", ["half-first-chunk", "first-chunk", "into-second-chunk"])
    def test_skip_tokens_leave_engine_slots_untouched(
        self, kv_case: LMCacheMetadata, skip: str
    ) -> None:
        cs = kv_case.chunk_size
        skip_tokens = {"half-first-chunk": cs // 2, "first-chunk": cs, "into-second-chunk": cs + 1}[
            skip
        ]
        scenario = _SCENARIOS[1]  # partial last chunk
        ranges = scenario.ranges(cs)
        n = scenario.num_tokens(cs)
        engine_a = self._engine(kv_case, "a", skip)
        spec_a = self._spec(engine_a, self._random_positions(engine_a, n))
        engine_b = self._engine(kv_case, "b", skip)
        pos_b = self._random_positions(engine_b, n)
        spec_b = self._spec(engine_b, pos_b, skip_tokens=skip_tokens)
        expected_b = self._snapshot(engine_b)
        conn_a = self._connector(kv_case, engine_a)
        conn_b = self._connector(kv_case, engine_b)
        with self._leased_chunks(conn_a, ranges) as chunks:
            conn_a.from_gpu(chunks, spec_a)
            conn_b.to_gpu(chunks, spec_b)
            conn_b.synchronize()
        expected_b[:, pos_b[skip_tokens:n]] = self._oracle(engine_a, spec_a, skip_tokens, n)
        _assert_bit_equal(
            self._snapshot(engine_b),
            expected_b,
            f"engine B after load with skip_tokens={skip_tokens}",
        )

    @pytest.mark.parametrize("direction", ["from_gpu", "to_gpu"])
    @pytest.mark.parametrize("defect", ["tokens", "width", "layers", "dtype"])
    def test_bad_chunk_buffer_rejected(
        self, kv_case: LMCacheMetadata, direction: str, defect: str
    ) -> None:
        cs = kv_case.chunk_size
        engine = self._engine(kv_case, "bad", direction, defect)
        connector = self._connector(kv_case, engine)
        spec = self._spec(engine, self._random_positions(engine, 2 * cs))
        before = self._snapshot(engine)
        layers, width, dtype = kv_case.num_layers, kv_case.kv_width, kv_case.kv_dtype
        shape = {
            "tokens": (layers, cs + 1, width),
            "width": (layers, cs, width + 1),
            "layers": (layers + 1, cs, width),
            "dtype": (layers, cs, width),
        }[defect]
        if defect == "dtype":
            dtype = torch.float16 if dtype != torch.float16 else torch.float32
        good = ChunkTransfer(0, cs, torch.randn(layers, cs, width).to(kv_case.kv_dtype))
        bad = ChunkTransfer(cs, 2 * cs, torch.zeros(shape, dtype=dtype))
        with pytest.raises(ValueError) as excinfo:
            getattr(connector, direction)([good, bad], spec)
        word = "dtype" if defect == "dtype" else "shape"
        assert word in str(excinfo.value).lower(), (
            f"{direction} rejected a bad buffer ({defect}) but the message does not say "
            f"{word!r}: {excinfo.value}"
        )
        connector.synchronize()
        _assert_bit_equal(
            self._snapshot(engine), before, f"engine cache after rejected {direction}"
        )

    def test_layerwise_round_trip_equals_batched(self, kv_case: LMCacheMetadata) -> None:
        cs = kv_case.chunk_size
        scenario = _SCENARIOS[1]
        ranges, n = scenario.ranges(cs), scenario.num_tokens(cs)
        engine_a = self._engine(kv_case, "a", "layerwise")
        conn_a = self._connector(kv_case, engine_a)
        if not supports_layerwise(conn_a):
            pytest.skip(f"{type(conn_a).__name__} does not implement SupportsLayerwise")
        assert isinstance(conn_a, SupportsLayerwise)
        spec_a = self._spec(engine_a, self._random_positions(engine_a, n))
        engine_b1 = self._engine(kv_case, "b", "layerwise")
        engine_b2 = self._engine(kv_case, "b", "layerwise")  # identical to b1
        pos_b = self._random_positions(engine_b1, n)
        spec_b = self._spec(engine_b1, pos_b, skip_tokens=cs // 2)
        conn_b1 = self._connector(kv_case, engine_b1)
        conn_b2 = self._connector(kv_case, engine_b2)
        assert isinstance(conn_b2, SupportsLayerwise)
        with (
            self._leased_chunks(conn_a, ranges) as batched,
            self._leased_chunks(conn_a, ranges) as layered,
        ):
            conn_a.from_gpu(batched, spec_a)
            for layer in range(conn_a.num_layers):
                conn_a.from_gpu_layer(layer, layered, spec_a)
            conn_a.synchronize()
            for b, lw in zip(batched, layered, strict=True):
                _assert_bit_equal(lw.buffer, b.buffer, f"from_gpu_layer chunk [{b.start}, {b.end})")
            conn_b1.to_gpu(batched, spec_b)
            for layer in range(conn_b2.num_layers):
                conn_b2.to_gpu_layer(layer, layered, spec_b)
            conn_b1.synchronize()
            conn_b2.synchronize()
        _assert_bit_equal(
            self._snapshot(engine_b2), self._snapshot(engine_b1), "layerwise load vs batched load"
        )


_SUITE_TESTS = frozenset(n for n in vars(GPUConnectorConformance) if n.startswith("test_"))
