# SPDX-License-Identifier: Apache-2.0
"""LoRA on real vLLM (CPU): each adapter gets its own KV from lmcache, never another's.

Two random adapters (built at test time, PEFT format) adapt q/k/v, so the same prompt has
different KV under the base model, adapter A and adapter B. A lmcache key that ignores the adapter
would hand B (or the base model) the KV that A stored: a 256-token "hit" and a wrong answer.
Every output is compared token for token with the same adapter's output without the connector.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lmcache_vllm.testing import build_random_lora

from .conftest import MAX_TOKENS, PROMPTS, engine_kwargs, ktc, shutdown_engine

# q/k/v only: an o_proj update writes a rank-8 direction into the tiny model's small residual
# stream and the greedy decode collapses to one repeated token, whatever the KV. Adapting q/k/v
# changes the KV of every layer while the decode still depends on it.
TARGETS = ("q_proj", "k_proj", "v_proj")
LORA = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2}
PROMPT = PROMPTS["p300"]  # 4 full chunks of 64 + a 44-token tail


@pytest.fixture(scope="module")
def adapters(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``{"A": LoRARequest, "B": LoRARequest}``: two random adapters of the tiny model."""
    from vllm.lora.request import LoRARequest

    root = tmp_path_factory.mktemp("lora")
    out = {}
    for int_id, (name, seed) in enumerate([("A", 1), ("B", 2)], start=1):
        path = build_random_lora(
            root / name, model_dir, rank=8, target_modules=TARGETS, seed=seed, scale=1.0
        )
        out[name] = LoRARequest(f"adapter-{name}", int_id, str(path))
    return out


class Engine:
    """One vLLM engine with LoRA enabled; :meth:`gen` runs ``PROMPT`` under an adapter."""

    def __init__(self, model_dir: Path, **overrides: Any) -> None:
        from vllm import LLM, SamplingParams

        self.llm = LLM(**engine_kwargs(model_dir, **LORA, **overrides))
        self.sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

    def gen(self, *loras: Any) -> list[tuple[list[int], int]]:
        """``(greedy tokens, num_cached_tokens)`` of ``PROMPT`` once per LoRA request (``None``:
        the base model), all in one batch, after emptying vLLM's own prefix cache."""
        assert self.llm.reset_prefix_cache()  # vLLM's own cache only; lmcache keeps its chunks
        outs = self.llm.generate(
            [{"prompt_token_ids": PROMPT}] * len(loras),
            self.sp,
            use_tqdm=False,
            lora_request=list(loras),
        )
        return [(list(o.outputs[0].token_ids), int(o.num_cached_tokens or 0)) for o in outs]


@pytest.fixture(scope="module")
def lora_baseline(model_dir: Path, adapters: dict[str, Any]) -> dict[str, list[int]]:
    """Greedy output of ``PROMPT`` per adapter (``"base"``: none), without any connector."""
    engine = Engine(model_dir, enable_prefix_caching=False)
    try:
        return {
            name: engine.gen(lora)[0][0]
            for name, lora in [("base", None), ("A", adapters["A"]), ("B", adapters["B"])]
        }
    finally:
        shutdown_engine(engine.llm)


@pytest.fixture
def engine(model_dir: Path) -> Iterator[Engine]:
    """A LoRA engine with the lmcache connector (chunk 64), on an empty lmcache tier."""
    e = Engine(model_dir, kv_transfer_config=ktc())
    try:
        yield e
    finally:
        shutdown_engine(e.llm)


def test_adapters_change_the_output(lora_baseline, baseline):
    """Control: the adapters matter, so a wrong KV would show in the tokens."""
    assert lora_baseline["base"] == baseline["p300"]  # enabling LoRA leaves the base model as is
    assert lora_baseline["A"] != lora_baseline["base"]
    assert lora_baseline["B"] != lora_baseline["base"]
    assert lora_baseline["A"] != lora_baseline["B"]


def test_each_adapter_hits_only_its_own_kv(engine, adapters, lora_baseline):
    a, b = adapters["A"], adapters["B"]
    assert engine.gen(a) == [(lora_baseline["A"], 0)]  # cold: stores A's KV
    # Same tokens, other adapter: A's chunks must not be offered (0 cached) nor loaded.
    assert engine.gen(b) == [(lora_baseline["B"], 0)], "adapter B was served adapter A's KV"
    assert engine.gen(a) == [(lora_baseline["A"], 256)]  # A hits its own 4 chunks
    assert engine.gen(b) == [(lora_baseline["B"], 256)]  # B's cold run stored B's own chunks
    # The base model (no LoRA) must not load either adapter's KV, then hits its own.
    assert engine.gen(None) == [(lora_baseline["base"], 0)], "the base model got an adapter's KV"
    assert engine.gen(None) == [(lora_baseline["base"], 256)]


def test_two_adapters_in_one_batch(engine, adapters, lora_baseline):
    """Same prompt under both adapters in one step: each loads only its own chunks.

    The base model is left out of the batch: vLLM 0.32's CPU LoRA ops (``lora/ops/torch_ops``)
    index the stacked adapter weights with a request's slot, and a request without LoRA has slot
    ``-1``, which picks the *last* loaded adapter. A base request batched with LoRA requests
    therefore answers like adapter B even without any connector.
    """
    a, b = adapters["A"], adapters["B"]
    engine.gen(a)  # only A's KV is stored
    assert engine.gen(a, b) == [(lora_baseline["A"], 256), (lora_baseline["B"], 0)]
    assert engine.gen(b, a) == [(lora_baseline["B"], 256), (lora_baseline["A"], 256)]


def _publish(cache: Path, repo: str, commit: str, adapter: Path) -> None:
    """Put ``adapter``'s files in a Hugging Face cache as ``repo``'s snapshot ``commit`` and
    point ``main`` at it, as a download of an updated adapter leaves them."""
    import shutil

    root = cache / ("models--" + repo.replace("/", "--"))
    shutil.copytree(adapter, root / "snapshots" / commit)
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(commit)


def test_hub_adapter_updated_under_the_same_id_gets_new_keys(
    engine, adapters, lora_baseline, tmp_path, monkeypatch
):
    """A LoRA adapter given by its hub id is loaded by vLLM from the Hugging Face cache (offline
    here): it hits its own KV, and after the adapter is updated on the hub (a new snapshot, same
    id and name) it gets other keys: no hit of the old weights' KV, the new weights' output."""
    import huggingface_hub.constants
    from vllm.lora.request import LoRARequest

    cache = tmp_path / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    _publish(cache, "org/tiny-lora", "1" * 40, Path(adapters["A"].lora_path))
    v1 = LoRARequest("tiny-lora", 11, "org/tiny-lora")
    assert engine.gen(v1) == [(lora_baseline["A"], 0)]
    assert engine.gen(v1) == [(lora_baseline["A"], 256)]

    _publish(cache, "org/tiny-lora", "2" * 40, Path(adapters["B"].lora_path))
    v2 = LoRARequest("tiny-lora", 12, "org/tiny-lora")  # a new slot: vLLM loads the new weights
    assert engine.gen(v2) == [(lora_baseline["B"], 0)], "the updated adapter got the old KV"
    assert engine.gen(v2) == [(lora_baseline["B"], 256)]
