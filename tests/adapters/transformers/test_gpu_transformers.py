"""The transformers adapter on CUDA with the real model: pages restored into GPU memory.

SmolLM2-135M-Instruct (real weights, :mod:`real_chat`) on the GPU continues a real chat from
pages a fresh store handle reads from disk and copies to the GPU through the staging pool's
pinned buffers; the oracles are those of ``tests/adapters/transformers/test_transformers_cache.py`` (bf16: the cache
turn 1 left in GPU memory, bit for bit, and the answer it gives; float32: one full forward).
Then the time to first token of a long prompt: recomputed, from the host tier, from the disk
tier, printed (and recorded as test properties), with no bar on the figures: they are measured
once on whatever GPU runs this, not a benchmark.

Marked ``gpu``; skipped without a CUDA device. ``scripts/gpu-check`` runs them.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from dss_adapters.staging import StagingPool
from dss_adapters.transformers.cache import cache_from_pages, cache_pages, layout_for, load_cache, save_cache

import dss
from tests import real_chat

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
NUM_STORED = 4096
"""Tokens of the long conversation whose pages the time-to-first-token test stores (128 pages)."""
REPEATS = 3


@pytest.fixture(scope="module")
def smol(smollm2_model: Path) -> tuple[Any, Any]:
    """SmolLM2-135M-Instruct in bf16 on the GPU, and its tokenizer."""
    return real_chat.load(smollm2_model, torch.bfloat16, "cuda")


@pytest.fixture(scope="module")
def smol32(smollm2_model: Path) -> tuple[Any, Any]:
    """SmolLM2-135M-Instruct in float32 on the GPU, and its tokenizer."""
    return real_chat.load(smollm2_model, torch.float32, "cuda")


@pytest.fixture
def store(sqlite_store: dss.Store) -> dss.Store:
    return sqlite_store


@pytest.fixture
def pool() -> Iterator[StagingPool]:
    staging = StagingPool("cuda")
    yield staging
    staging.wait_all()


def test_a_real_chat_on_the_gpu_continues_from_pages_on_disk_as_from_the_cache_in_memory(
    smol: tuple[Any, Any], store: dss.Store, store_path: Path, pool: StagingPool
) -> None:
    model, tokenizer = smol
    chat = real_chat.through_the_store(model, tokenizer, store, store_path, staging=pool)
    assert "Paris" in tokenizer.decode(real_chat.answer(chat.turn1, chat.prompt1))
    in_memory = real_chat.prefix_of(chat.turn1.past_key_values, chat.num_cached)
    assert chat.cache.layers[0].keys.is_cuda and real_chat.same_tensors(chat.cache, in_memory)
    turn2 = chat.turn2
    restored = real_chat.answer(real_chat.greedy(model, turn2, 16, cache=chat.cache), turn2)
    assert restored == real_chat.answer(real_chat.greedy(model, turn2, 16, cache=in_memory), turn2)


def test_in_float32_on_the_gpu_a_real_chat_continues_from_pages_as_from_one_full_forward(
    smol32: tuple[Any, Any], store: dss.Store, store_path: Path, pool: StagingPool
) -> None:
    model, tokenizer = smol32
    chat = real_chat.through_the_store(model, tokenizer, store, store_path, staging=pool)
    turn2 = chat.turn2
    restored = real_chat.answer(real_chat.greedy(model, turn2, 16, cache=chat.cache), turn2)
    assert restored == real_chat.answer(real_chat.greedy(model, turn2, 16), turn2)


def test_pages_built_on_the_gpu_through_pinned_buffers_equal_the_ones_built_on_the_cpu(
    smol: tuple[Any, Any], pool: StagingPool
) -> None:
    from transformers import DynamicCache

    layout = layout_for(smol[0], page_tokens=32)
    generator = torch.Generator().manual_seed(0)
    shape = (1, layout.num_kv_heads, 96, layout.head_dim)
    tensors = [
        (
            torch.randn(shape, generator=generator).to(torch.bfloat16),
            torch.randn(shape, generator=generator).to(torch.bfloat16),
        )
        for _ in range(layout.num_layers)
    ]
    pages = cache_pages(DynamicCache(tensors), layout)
    on_gpu = cache_from_pages([pages[0], pages[1], pages[2]], layout, device="cuda", staging=pool)
    again = pool.stage([pages[0]], [(0, layout.page_bytes)])  # the buffer the pages went through, back in the pool
    assert pool.num_buffers == 1 and again.buffer.is_pinned()
    pool.copy(again, lambda staged: None).wait()
    for (keys, values), layer in zip(tensors, on_gpu.layers):
        assert layer.keys.is_cuda and torch.equal(layer.keys.cpu(), keys) and torch.equal(layer.values.cpu(), values)
    assert cache_pages(on_gpu, layout) == pages  # and back from the GPU, byte for byte


def first_token(model: Any, tokens: list[int], cache: Any = None) -> int:
    """The greedy next token after ``tokens`` (only those the cache lacks are computed); waits for the GPU."""
    held = 0 if cache is None else cache.get_seq_length()
    ids = torch.tensor([tokens[held:]], device=model.device)
    with torch.no_grad():
        logits = model(ids, past_key_values=cache, use_cache=cache is not None).logits
    return int(logits[0, -1].argmax())


def timed(run: Callable[[], int]) -> tuple[float, int]:
    """Milliseconds of one call of ``run`` (from an idle GPU until its token is back), and the token."""
    torch.cuda.synchronize()
    started = time.perf_counter()
    token = run()
    return (time.perf_counter() - started) * 1000, token


def test_time_to_first_token_recomputed_from_the_host_tier_and_from_the_disk_tier(
    smol: tuple[Any, Any],
    store: dss.Store,
    store_path: Path,
    pool: StagingPool,
    capsys: pytest.CaptureFixture[str],
    record_property: Callable[[str, object], None],
) -> None:
    """A 4,096-token conversation is stored (its prefill's cache, 128 pages); the next turn's
    first token is then computed from scratch, from pages this handle holds in RAM, and from
    pages a fresh handle reads from disk (the OS page cache is warm after the first read).
    Both hits give the token the same split gives without dss; figures are medians of 3."""
    model, tokenizer = smol
    layout = layout_for(model, page_tokens=32)
    history = real_chat.long_history(tokenizer, NUM_STORED)
    with torch.no_grad():
        prefill = model(torch.tensor([history], device="cuda"), use_cache=True).past_key_values
    store.create_session("long", user_id="u", tenant_id="t", layout=layout)
    assert save_cache(store, prefill, history, layout, session_id="long", tenant_id="t") == NUM_STORED // 32
    store.commit("long", history, tenant_id="t")
    turn = real_chat.next_turn(tokenizer, history)
    expected = first_token(model, turn, real_chat.prefix_of(prefill, NUM_STORED))

    def hit(handle: dss.Store, tier: str) -> int:
        result = handle.resume("long", turn, tenant_id="t")
        assert result.tiers == {tier: NUM_STORED}
        cache, num_cached = load_cache(handle, result, layout, limit=len(turn) - 1, device="cuda", staging=pool)
        assert num_cached == NUM_STORED
        return first_token(model, turn, cache)

    def from_disk() -> tuple[float, int]:
        with dss.open(store_path) as fresh:  # opened before the clock starts; its host tier is empty
            return timed(lambda: hit(fresh, "disk"))

    figures: dict[str, float] = {}
    for name, run in [
        ("recompute", lambda: timed(lambda: first_token(model, turn))),
        ("host hit", lambda: timed(lambda: hit(store, "host"))),
        ("disk hit", from_disk),
    ]:
        run()  # warm-up: CUDA kernels, the pool's pinned buffer
        samples = [run() for _ in range(REPEATS)]
        if name != "recompute":  # bf16: a prefix computed apart rounds apart; the same split must agree
            assert [token for _, token in samples] == [expected] * REPEATS
        figures[name] = statistics.median(ms for ms, _ in samples)
        record_property(f"ttft_ms[{name}]", round(figures[name], 2))
    with capsys.disabled():
        print(
            f"\ntime to first token, SmolLM2-135M bf16 on {torch.cuda.get_device_name()}, {len(turn)}-token "
            f"prompt, {NUM_STORED} tokens stored (median of {REPEATS}):"
        )
        for name, ms in figures.items():
            print(f"  {name:<10} {ms:8.2f} ms")
