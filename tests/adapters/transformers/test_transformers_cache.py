"""The transformers adapter: a ``past_key_values`` cache saved as dss pages and built back.

The real model, SmolLM2-135M-Instruct (real weights, :mod:`real_chat`), continues a real chat
from pages restored out of the store (a fresh store handle: they come from disk): in bf16 the
restored cache is the one turn 1 left in memory, bit for bit, and the next answer is the one
that cache gives; in float32 the next answer is the one a full forward over the whole prompt
gives. A tiny random Llama (the one of :mod:`engines`) covers what the real model cannot show
on its own: arbitrary shapes, a page layout worked by hand, refused caches.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from dss_adapters.dequantize import dequantize
from dss_adapters.transformers.cache import cache_from_pages, cache_pages, layout_for, load_cache, save_cache

import dss
from tests import real_chat
from tests.engines import make_tiny_llama, prompt


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import LlamaForCausalLM

    path = make_tiny_llama(tmp_path_factory.mktemp("hf") / "tiny-llama")
    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture
def store(sqlite_store: dss.Store) -> dss.Store:
    """The test's own handle on the store (SQLite: the engines open the same folder)."""
    return sqlite_store


def greedy(model: Any, tokens: list[int], n: int, cache: Any = None) -> Any:
    with torch.no_grad():
        return model.generate(
            torch.tensor([tokens]),
            past_key_values=cache,
            max_new_tokens=n,
            do_sample=False,
            return_dict_in_generate=True,
            pad_token_id=0,
        )


def test_generation_from_a_restored_cache_equals_generation_from_scratch(
    model: Any, store: dss.Store, store_path: Path
) -> None:
    layout = layout_for(model, page_tokens=32)
    store.create_session("chat-1", user_id="u", tenant_id="t", layout=layout)
    turn1 = greedy(model, prompt(1, 100), 20)
    history = turn1.sequences[0].tolist()  # 120 tokens; the cache holds the first 119
    assert save_cache(store, turn1.past_key_values, history, layout, session_id="chat-1", tenant_id="t") == 3
    store.commit("chat-1", history, tenant_id="t")

    turn2 = history + prompt(2, 30)
    with dss.open(store_path) as fresh:  # another handle: its host tier is empty, pages come from disk
        result = fresh.resume("chat-1", turn2, tenant_id="t")
        assert (result.matched_tokens, result.tiers) == (96, {"disk": 96})
        cache, num_cached = load_cache(fresh, result, layout, limit=len(turn2) - 1)
    assert num_cached == 96
    assert cache.get_seq_length() == 96
    restored = greedy(model, turn2, 24, cache=cache).sequences[0].tolist()
    scratch = greedy(model, turn2, 24).sequences[0].tolist()
    assert restored == scratch
    assert len(restored) == len(turn2) + 24


def test_a_cache_of_wrong_values_changes_the_output(model: Any) -> None:
    """The control that shows the test above can fail: zero KV for the same 96 tokens."""
    layout = layout_for(model, page_tokens=32)
    tokens = prompt(1, 100) + prompt(2, 30)
    zeros = cache_from_pages([bytes(layout.page_bytes)] * 3, layout)
    assert (
        greedy(model, tokens, 24, cache=zeros).sequences[0].tolist() != greedy(model, tokens, 24).sequences[0].tolist()
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pages_round_trip_bit_for_bit(model: Any, dtype: torch.dtype) -> None:
    from transformers import DynamicCache

    layout = layout_for(model, page_tokens=32, dtype=dtype)
    generator = torch.Generator().manual_seed(0)
    tensors = [
        (
            torch.randn(1, 2, 70, 32, generator=generator).to(dtype),
            torch.randn(1, 2, 70, 32, generator=generator).to(dtype),
        )
        for _ in range(2)
    ]
    pages = cache_pages(DynamicCache(tensors), layout)
    assert sorted(pages) == [0, 1]
    assert all(len(p) == layout.page_bytes == 2 * 2 * 2 * 32 * 32 * dtype.itemsize for p in pages.values())
    rebuilt = cache_from_pages([pages[0], pages[1]], layout)
    for (k, v), layer in zip(tensors, rebuilt.layers):
        assert torch.equal(layer.keys, k[:, :, :64]) and torch.equal(layer.values, v[:, :, :64])
    # page 1 holds tokens 32-63 of layer 0's keys first: [layers][k, v] x [heads, tokens, head_dim]
    first = torch.frombuffer(bytearray(pages[1][: 2 * 32 * 32 * dtype.itemsize]), dtype=dtype).view(2, 32, 32)
    assert torch.equal(first, tensors[0][0][0, :, 32:64])


@pytest.mark.parametrize(
    ("encoding", "key_err", "value_err"), [("int8", 0.04, 0.04), ("fp8", 0.35, 0.35), ("k8v4", 0.04, 0.8)]
)
def test_pages_a_disk_keeps_at_lower_precision_are_dequantized_into_the_cache(
    model: Any, tmp_path: Path, encoding: str, key_err: float, value_err: float
) -> None:
    """Disk at ``encoding``: a fresh handle (host tier empty) reads the lossy copies, the result
    says so, and the cache holds the KV dequantized into bf16, within a quantization step of
    the row's absmax (randn rows: absmax about 3; int8 step 3/127, e4m3 about 3/16, int4 3/7)."""
    from transformers import DynamicCache

    layout = layout_for(model, page_tokens=32, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(1)
    tensors = [tuple(torch.randn(1, 2, 64, 32, generator=generator).to(torch.bfloat16) for _ in "kv") for _ in range(2)]
    tokens = prompt(3, 64) + [7]
    with dss.open(tmp_path / "s", disk_precision=encoding) as store:
        store.create_session("c", user_id="u", tenant_id="t", layout=layout)
        assert save_cache(store, DynamicCache(tensors), tokens, layout, session_id="c", tenant_id="t") == 2
        store.commit("c", tokens, tenant_id="t")
    with dss.open(tmp_path / "s", disk_precision=encoding) as fresh:
        result = fresh.resume("c", tokens, tenant_id="t")
        assert (result.tiers, result.encodings, result.lossy_tokens) == ({"disk": 64}, {encoding: 64}, 64)
        cache, num_cached = load_cache(fresh, result, layout)
    assert num_cached == 64
    for (k, v), layer in zip(tensors, cache.layers):
        assert layer.keys.dtype == torch.bfloat16 and layer.keys.shape == k.shape
        assert 0 < (layer.keys.float() - k.float()).abs().max() <= key_err
        assert 0 < (layer.values.float() - v.float()).abs().max() <= value_err


@pytest.mark.parametrize("encoding", ["int8", "fp8", "k8v4"])
def test_torch_dequantization_equals_the_reference(model: Any, encoding: str) -> None:
    """The adapter's torch kernels give the bytes of dss's numpy reference decoder, bit for bit."""
    from dss.core import packing

    layout = layout_for(model, page_tokens=32, dtype=torch.bfloat16)
    shape = packing.shape_of(layout)
    assert shape is not None
    exact = torch.randn(shape.num_parts, shape.rows, shape.head_dim, generator=torch.Generator().manual_seed(2))
    blob = packing.encode(exact.to(torch.bfloat16).view(torch.uint8).numpy().tobytes(), shape, encoding)
    assert blob is not None
    parts = dss.page_views(blob, layout)
    assert parts is not None and parts.encoding == encoding
    mine = dequantize(parts, torch.bfloat16).view(torch.uint8).numpy().tobytes()
    assert mine == bytes(dss.decode_page(blob, layout))


def test_a_cache_of_exact_and_encoded_pages_holds_each_page_as_the_reference_decodes_it(model: Any) -> None:
    """Pages of every encoding, mixed in one load (a prefix partly in an exact tier, partly in a
    lossy one): the cache holds each page as dss's numpy decoder gives it, bit for bit, the exact
    pages as they were saved; the cache's tensors are views of one tensor, each layer's keys and
    values contiguous."""
    from dss.core import packing

    layout = layout_for(model, page_tokens=32, dtype=torch.bfloat16)
    shape = packing.shape_of(layout)
    assert shape is not None
    generator = torch.Generator().manual_seed(3)
    exact = [
        (3 * torch.randn(shape.num_parts, shape.rows, shape.head_dim, generator=generator))
        .to(torch.bfloat16)
        .view(torch.uint8)
        .numpy()
        .tobytes()
        for _ in range(7)
    ]
    encodings = ["exact", "int8", "int8", "fp8", "exact", "k8v4", "k8v4"]
    stored = [page if e == "exact" else packing.encode(page, shape, e) for page, e in zip(exact, encodings)]
    assert [dss.page_encoding(p) for p in stored] == encodings  # type: ignore[arg-type]
    cache = cache_from_pages(stored, layout)  # type: ignore[arg-type]
    decoded = [bytes(dss.decode_page(p, layout)) for p in stored]  # type: ignore[arg-type]
    assert decoded[0] == exact[0] and decoded[4] == exact[4]
    assert cache_pages(cache, layout) == dict(enumerate(decoded))
    assert all(layer.keys.is_contiguous() and layer.values.is_contiguous() for layer in cache.layers)


def test_layouts_of_other_precisions_page_sizes_or_revisions_never_match(model: Any, store: dss.Store) -> None:
    base = layout_for(model, page_tokens=32)
    assert base.page_bytes == 2 * 2 * 2 * 32 * 32 * 4
    assert (base.dtype, base.num_layers, base.num_kv_heads, base.head_dim) == ("float32", 2, 2, 32)
    others = [
        layout_for(model, page_tokens=32, dtype=torch.bfloat16),
        layout_for(model, page_tokens=64),
        layout_for(model, page_tokens=32, revision="v2"),
    ]
    assert len({base.digest, *(o.digest for o in others)}) == 4
    tokens = prompt(5, 64)
    store.save_pages(
        None, tokens, {0: bytes(base.page_bytes), 1: bytes(base.page_bytes)}, tenant_id="t", user_id="u", layout=base
    )
    assert store.lookup(tokens, layout=base, user_id="u", tenant_id="t").matched_tokens == 64
    assert [store.lookup(tokens, layout=o, user_id="u", tenant_id="t").matched_tokens for o in others] == [0, 0, 0]


def test_caches_that_do_not_fit_the_layout_are_refused(model: Any) -> None:
    from transformers import DynamicCache

    layout = layout_for(model, page_tokens=32)
    batch = DynamicCache([(torch.zeros(2, 2, 32, 32), torch.zeros(2, 2, 32, 32))] * 2)
    with pytest.raises(dss.InvalidInput, match=r"cache tensors must be \[1, 2, tokens, 32\]"):
        cache_pages(batch, layout)
    half = DynamicCache([(torch.zeros(1, 2, 32, 32, dtype=torch.float16),) * 2] * 2)
    with pytest.raises(dss.InvalidInput, match="cache dtype torch.float16 is not the layout's float32"):
        cache_pages(half, layout)
    with pytest.raises(dss.InvalidInput, match="the cache has 1 layers; the layout 2"):
        cache_pages(DynamicCache([(torch.zeros(1, 2, 32, 32),) * 2]), layout)
    with pytest.raises(dss.InvalidInput, match="page 0 has 3 bytes"):
        cache_from_pages([b"abc"], layout)


# -- the real model ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol(smollm2_model: Path) -> tuple[Any, Any]:
    """SmolLM2-135M-Instruct in bf16 on the CPU, and its tokenizer."""
    return real_chat.load(smollm2_model, torch.bfloat16)


@pytest.fixture(scope="module")
def smol32(smollm2_model: Path) -> tuple[Any, Any]:
    """SmolLM2-135M-Instruct in float32 on the CPU, and its tokenizer."""
    return real_chat.load(smollm2_model, torch.float32)


def test_the_real_models_layout(smol: tuple[Any, Any]) -> None:
    """30 layers x (k, v) x 3 KV heads x 32 tokens x 64 dims x 2 bytes (bf16) = 737,280 bytes a page."""
    layout = layout_for(smol[0], page_tokens=32)
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype) == (30, 3, 64, "bfloat16")
    assert layout.page_bytes == 30 * 2 * 3 * 32 * 64 * 2 == 737_280


def test_a_real_chat_continues_from_pages_on_disk_as_from_the_cache_in_memory(
    smol: tuple[Any, Any], store: dss.Store, store_path: Path
) -> None:
    """bf16: the restored cache is turn 1's cache bit for bit, so turn 2's greedy answer is the
    one the in-memory cache gives (the same split without dss)."""
    model, tokenizer = smol
    chat = real_chat.through_the_store(model, tokenizer, store, store_path)
    assert "Paris" in tokenizer.decode(real_chat.answer(chat.turn1, chat.prompt1))  # real weights
    in_memory = real_chat.prefix_of(chat.turn1.past_key_values, chat.num_cached)
    assert real_chat.same_tensors(chat.cache, in_memory)
    turn2 = chat.turn2
    restored = real_chat.answer(real_chat.greedy(model, turn2, 16, cache=chat.cache), turn2)
    assert restored == real_chat.answer(real_chat.greedy(model, turn2, 16, cache=in_memory), turn2)
    assert len(restored) > 4 and tokenizer.decode(restored).strip()


def test_in_float32_a_real_chat_continues_from_pages_as_from_one_full_forward(
    smol32: tuple[Any, Any], store: dss.Store, store_path: Path
) -> None:
    model, tokenizer = smol32
    chat = real_chat.through_the_store(model, tokenizer, store, store_path)
    assert chat.cache.layers[0].keys.dtype == torch.float32
    turn2 = chat.turn2
    restored = real_chat.answer(real_chat.greedy(model, turn2, 16, cache=chat.cache), turn2)
    assert restored == real_chat.answer(real_chat.greedy(model, turn2, 16), turn2)
