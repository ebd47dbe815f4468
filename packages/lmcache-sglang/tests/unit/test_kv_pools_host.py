# SPDX-License-Identifier: Apache-2.0
"""HiCache host pools are told apart by their attributes on every supported SGLang.

SGLang 0.5.17's ``MHATokenToKVPoolHost`` has ``head_num`` / ``head_dim`` but no ``v_head_dim``
(0.5.23's has both); reading it as MLA made our HiCache backend refuse 0.5.17 at start-up
("SGLang says is_mla_model=False but the host pool MHATokenToKVPoolHost is MLA"), seen on an H200.
The classes below carry exactly the attributes ``host_pool_layers`` reads from each version's pool
(the real pools are exercised in ``tests/integration/test_hicache_backend.py`` on 0.5.23).
"""

from __future__ import annotations

import pytest
import torch

from lmcache_sglang.kv_pools import host_pool_layers

LAYERS, SLOTS, HEADS, DIM, PAGE = 2, 64, 2, 8, 16


class MHATokenToKVPoolHost:  # SGLang 0.5.17: no v_head_dim
    def __init__(self, layout: str) -> None:
        self.layout, self.layer_num, self.page_size = layout, LAYERS, PAGE
        self.head_num, self.head_dim = HEADS, DIM
        dims = {
            "layer_first": (2, LAYERS, SLOTS, HEADS, DIM),
            "page_first": (2, SLOTS, LAYERS, HEADS, DIM),
            "page_first_direct": (2, SLOTS // PAGE, LAYERS, PAGE, HEADS, DIM),
        }[layout]
        self.kv_buffer = torch.zeros(dims, dtype=torch.bfloat16)


class MHATokenToKVPoolHostWithV(MHATokenToKVPoolHost):  # SGLang 0.5.23
    def __init__(self, layout: str) -> None:
        super().__init__(layout)
        self.v_head_dim = DIM


class MLATokenToKVPoolHost:
    def __init__(self) -> None:
        self.layout, self.layer_num, self.page_size = "layer_first", LAYERS, PAGE
        self.kv_buffer = torch.zeros((LAYERS, SLOTS, 1, 24), dtype=torch.bfloat16)


@pytest.mark.parametrize("cls", [MHATokenToKVPoolHost, MHATokenToKVPoolHostWithV])
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_mha_host_pool_is_mha(cls: type, layout: str) -> None:
    layers = host_pool_layers(cls(layout))
    assert not layers.use_mla
    assert (layers.num_kv_heads, layers.head_size_k, layers.head_size_v) == (HEADS, DIM, DIM)
    assert len(layers.kv_caches) == LAYERS


def test_mla_host_pool_is_mla() -> None:
    layers = host_pool_layers(MLATokenToKVPoolHost())
    assert layers.use_mla
    assert (layers.num_kv_heads, layers.head_size_k, layers.head_size_v) == (1, 24, 0)
