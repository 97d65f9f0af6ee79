"""Reuse past a divergence (dss_adapters/transformers/blend.py) on the real model,
SmolLM2-135M-Instruct in float32 (so a full prefill is the oracle, see :mod:`real_chat`).

A real chat is stored with its KV; the next request re-renders a timestamp line in the system
prompt, or drops the first exchange. What is checked exactly: the exact prefix is the stored
KV bit for bit; recomputing everything after it is a full prefill; a moved run's keys,
re-rotated, are at layer 0 (where KV depends only on the token and its position) the keys a
prefill computes; with a share selected, the layers up to the selecting one are a prefill's;
the selection's attention weight is what eager attention pays, and each group of queries
(the prompt's last positions, the divergent and new tokens, both) picks exactly the reused
tokens whose error times that weight is highest; the report's counts add up and
``blend_metrics`` counts them. What is checked against a bar: the default share gives the full
prefill's next token with a small KL.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from dss_adapters.transformers.blend import aligned_runs, blend_cache, blend_metrics, reused_positions
from dss_adapters.transformers.blend_select import MIN_DEVIATION, attention_mass, kv_error, select
from dss_adapters.transformers.cache import layout_for, save_cache

import dss
from dss import InvalidInput
from tests import real_chat

ANSWER = "Paris is the capital of France. It has been the seat of government for most of the last thousand years."
NEXT = "And why would reading stored tensors from disk be slower than from host memory?"


@pytest.fixture(scope="module")
def chat(smollm2_model: Path) -> tuple[Any, Any]:
    return real_chat.load(smollm2_model, torch.float32)


def render(tok: Any, messages: list[dict[str, str]], when: str | None, *, ask: bool) -> list[int]:
    system = real_chat.SYSTEM + (f"\nCurrent time: {when}" if when else "")
    text = tok.apply_chat_template(
        [{"role": "system", "content": system}, *messages], tokenize=False, add_generation_prompt=ask
    )
    return real_chat.encode(tok, text)


def exchanges(n: int) -> list[dict[str, str]]:
    out = [{"role": "user", "content": real_chat.QUESTION}, {"role": "assistant", "content": ANSWER}]
    out += [{"role": "user", "content": real_chat.FOLLOW_UP}, {"role": "assistant", "content": ANSWER}]
    return out[: 2 * n]


def stored_chat(model: Any, store: dss.Store, tokens: list[int]) -> dss.Layout:
    """``tokens`` committed to session ``chat`` with the KV of one prefill (pages of 16)."""
    layout = layout_for(model, page_tokens=16)
    store.create_session("chat", user_id="u", layout=layout)
    with torch.no_grad():
        out = model(torch.tensor([tokens]), use_cache=True)
    save_cache(store, out.past_key_values, tokens, layout, session_id="chat")
    store.commit("chat", tokens)
    return layout


def prefill(model: Any, tokens: list[int]) -> Any:
    with torch.no_grad():
        return model(torch.tensor([tokens]), use_cache=True)


def kl(full: torch.Tensor, other: torch.Tensor) -> float:
    p, q = full.float().log_softmax(-1), other.float().log_softmax(-1)
    return float(torch.sum(p.exp() * (p - q)))


def end_logits(model: Any, cache: Any, last: int) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([[last]]), past_key_values=cache).logits[0, -1]


def test_a_rerendered_timestamp_reuses_the_rest_and_the_default_keeps_the_next_token(chat, sqlite_store) -> None:
    model, tok = chat
    stored = render(tok, exchanges(2), "10:31:07", ask=False)
    layout = stored_chat(model, sqlite_store, stored)
    prompt = render(tok, [*exchanges(2), {"role": "user", "content": NEXT}], "10:42:55", ask=True)
    before = blend_metrics()
    cache, report = blend_cache(sqlite_store, model, prompt[:-1], layout, session_id="chat")
    n_src = len(stored) // 16 * 16
    exact = int(np.flatnonzero(np.asarray(stored[: len(prompt)]) != np.asarray(prompt[: len(stored)]))[0])
    assert (report.source_session, report.source_version, report.exact_prefix_tokens) == ("chat", 1, exact)
    assert [(i == j, i + n) for i, j, n in report.runs] == [(True, n_src)]  # one run to the stored KV's end
    assert report.reused_tokens + report.selected_tokens == n_src - report.runs[0][0]
    assert report.reused_tokens + report.exact_prefix_tokens + report.recomputed_tokens == len(prompt) - 1
    assert report.moved_tokens == 0 and report.approximate and report.recompute == 0.3
    assert report.exact_prefix_tokens + report.reused_tokens >= 0.6 * len(prompt)  # 164 of 227
    assert cache.get_seq_length() == len(prompt) - 1
    full = prefill(model, prompt)
    src = prefill(model, stored).past_key_values
    for layer, mine in zip(src.layers, cache.layers):  # the exact prefix is the stored KV, bit for bit
        assert torch.equal(mine.keys[:, :, :exact], layer.keys[:, :, :exact])
    logits = end_logits(model, cache, prompt[-1])
    assert logits.argmax() == full.logits[0, -1].argmax()
    assert kl(full.logits[0, -1], logits) < 0.02
    after = blend_metrics()
    _, alone = blend_cache(sqlite_store, model, prompt[:-1], layout, session_id=None, user_id="u")
    assert alone == report  # without the session: the namespace's nearest, the same one
    assert after["blends"] == before["blends"] + 1 and after["approximate_blends"] == before["approximate_blends"] + 1
    assert after["reused_tokens"] == before["reused_tokens"] + report.reused_tokens
    assert after["recomputed_tokens"] == before["recomputed_tokens"] + report.recomputed_tokens
    assert after["exact_tokens"] == before["exact_tokens"] + report.exact_prefix_tokens


def test_recomputing_everything_after_the_exact_prefix_is_a_full_prefill(chat, sqlite_store) -> None:
    model, tok = chat
    stored = render(tok, exchanges(1), "10:31:07", ask=False)
    layout = stored_chat(model, sqlite_store, stored)
    prompt = render(tok, [*exchanges(1), {"role": "user", "content": NEXT}], "10:42:55", ask=True)
    cache, report = blend_cache(sqlite_store, model, prompt, layout, session_id="chat", recompute=1.0)
    assert (report.reused_tokens, report.approximate) == (0, False)
    assert report.recomputed_tokens == len(prompt) - report.exact_prefix_tokens
    full = prefill(model, prompt).past_key_values
    for mine, theirs in zip(cache.layers, full.layers):
        torch.testing.assert_close(mine.keys, theirs.keys, atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(mine.values, theirs.values, atol=2e-4, rtol=1e-4)


def test_a_dropped_exchange_moves_the_rest_and_its_keys_are_re_rotated(chat, sqlite_store) -> None:
    """Layer 0's keys depend only on the token and its position: a moved run's keys, re-rotated,
    are the keys a prefill computes at the new positions. With a share selected, layers
    ``0..select_layer`` are a prefill's at every position, and ``blend_metrics`` counts the
    blend and its tokens."""
    model, tok = chat
    stored = render(tok, exchanges(2), None, ask=False)
    layout = stored_chat(model, sqlite_store, stored)
    prompt = render(tok, [*exchanges(2)[2:], {"role": "user", "content": NEXT}], None, ask=True)
    cache, report = blend_cache(sqlite_store, model, prompt, layout, session_id="chat", recompute=0.0)
    assert report.runs and all(j > i for i, j, _ in report.runs)
    assert report.moved_tokens == report.reused_tokens > 0 and report.selected_tokens == 0
    full = prefill(model, prompt).past_key_values
    i, _, n = report.runs[0]
    torch.testing.assert_close(
        cache.layers[0].keys[:, :, i : i + n], full.layers[0].keys[:, :, i : i + n], atol=2e-4, rtol=1e-4
    )
    torch.testing.assert_close(
        cache.layers[0].values[:, :, i : i + n], full.layers[0].values[:, :, i : i + n], atol=2e-5, rtol=1e-5
    )
    before = blend_metrics()
    cache, report = blend_cache(sqlite_store, model, prompt, layout, session_id="chat", recompute=0.3, select_layer=4)
    assert 0 < report.selected_tokens <= 0.3 * (report.reused_tokens + report.selected_tokens) + 1
    for mine, theirs in zip(cache.layers[:5], full.layers[:5]):  # layers 0..select_layer: computed for all
        torch.testing.assert_close(mine.keys, theirs.keys, atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(mine.values, theirs.values, atol=2e-4, rtol=1e-4)
    after = blend_metrics()
    assert {key: after[key] - before[key] for key in after} == {
        "blends": 1,
        "approximate_blends": 1,
        "reused_tokens": report.reused_tokens,
        "recomputed_tokens": report.recomputed_tokens,
        "exact_tokens": report.exact_prefix_tokens,
    }


def test_with_nothing_stored_it_is_a_prefill_and_nonsense_is_refused(chat, sqlite_store) -> None:
    model, tok = chat
    layout = layout_for(model, page_tokens=16)
    sqlite_store.create_session("empty", user_id="u", layout=layout)
    prompt = render(tok, exchanges(1), None, ask=True)
    cache, report = blend_cache(sqlite_store, model, prompt, layout, session_id="empty")
    assert (report.source_session, report.exact_prefix_tokens, report.reused_tokens, report.runs) == (None, 0, 0, [])
    assert report.recomputed_tokens == len(prompt)
    full = prefill(model, prompt).past_key_values
    torch.testing.assert_close(cache.layers[5].keys, full.layers[5].keys, atol=2e-4, rtol=1e-4)
    for kwargs, message in (
        ({"recompute": 1.5}, "recompute must be a share from 0 to 1"),
        ({"recompute": True}, "recompute must be a share from 0 to 1"),
        ({"select_layer": 30}, "select_layer must be a layer index from 0 to 29"),
        ({"queries": "last:0"}, "queries must be 'computed', 'last:N' or 'both:N'"),
        ({"queries": None}, "queries must be 'computed', 'last:N' or 'both:N'"),
    ):
        with pytest.raises(InvalidInput, match=message):
            blend_cache(sqlite_store, model, prompt, layout, session_id="empty", **kwargs)
    with pytest.raises(InvalidInput, match="layout is not the layout of session 'empty'"):
        blend_cache(sqlite_store, model, prompt, layout_for(model, page_tokens=32), session_id="empty")
    with pytest.raises(InvalidInput, match="at least one token"):
        blend_cache(sqlite_store, model, [], layout, session_id="empty")


def test_aligned_runs_follow_both_sequences_in_order() -> None:
    stored = np.arange(100, 160)
    prompt = np.concatenate([stored[:10], [1, 2, 3], stored[30:50], stored[10:20], [7] * 9])
    assert aligned_runs(prompt, stored, 10) == [(13, 30, 20)]  # stored[10:20] comes before: not reused after 50
    assert aligned_runs(prompt[:5], stored, 0) == []
    assert aligned_runs(np.concatenate([stored[:20], stored[25:45]]), stored, 20) == [(20, 25, 20)]


def test_the_blend_block(tmp_path: Path, smollm2_model: Path) -> None:
    """docs/approximate.md's example runs as written and reuses past the time line."""
    from tests.docblocks import blocks_run_by
    from tests.test_docs_engines import run_python

    (block,) = blocks_run_by("test_the_blend_block")
    exact, reused, recomputed, approximate = run_python(block.text, tmp_path).split()[-4:]
    assert approximate == "True" and int(exact) > 0 and int(reused) > 0 and int(recomputed) > 0


def test_the_attention_mass_is_what_an_eager_forward_pays(chat) -> None:
    """The selection's weight: the attention of the chosen queries to each key, summed over
    queries and heads, as transformers' eager attention computes it."""
    model, tok = chat
    ids = render(tok, exchanges(1), None, ask=True)
    seen: dict[str, Any] = {}
    hook = model.model.layers[3].self_attn.register_forward_pre_hook(
        lambda _, args, kwargs: seen.update(kwargs), with_kwargs=True
    )
    before = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_attentions=True, use_cache=True)
    finally:
        hook.remove()
        model.set_attn_implementation(before)
    rows = np.arange(len(ids) - 12, len(ids))
    mass = attention_mass(model, 3, seen, out.past_key_values.layers[3].keys, rows, 0)
    expected = out.attentions[3][0][:, torch.as_tensor(rows)].sum(dim=(0, 1))
    torch.testing.assert_close(mass, expected.float(), atol=1e-4, rtol=1e-4)
    assert float(mass.sum()) == pytest.approx(len(rows) * model.config.num_attention_heads, rel=1e-5)


@pytest.mark.parametrize("queries", ["computed", "last:4", "both:4"])
def test_the_queries_chosen_weigh_each_reused_tokens_error(chat, queries) -> None:
    """``select`` ranks the reused tokens after the exact prefix by their KV error at the
    selecting layer times the attention that the chosen queries pay them there (eager attention,
    summed over heads, averaged over the queries of each group): the divergent and new tokens
    (``computed``), the prompt's last 4 positions (``last:4``) or the two groups added
    (``both:4``). The top share is chosen, exactly; the groups choose differently."""
    model, tok = chat
    stored = render(tok, exchanges(2), None, ask=False)
    prompt = np.asarray(render(tok, [*exchanges(2)[2:], {"role": "user", "content": NEXT}], None, ask=True))
    src = prefill(model, stored).past_key_values
    exact = int(np.flatnonzero(prompt[: len(stored)] != np.asarray(stored[: len(prompt)]))[0])
    pos, old = reused_positions(exact, aligned_runs(prompt, np.asarray(stored), exact))
    chosen, fresh, _ = select(model, src, prompt, pos, old, exact, 0.3, 4, queries=queries)
    before = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model(torch.tensor([prompt.tolist()]), output_attentions=True, use_cache=True)
    finally:
        model.set_attn_implementation(before)
    attention = out.attentions[4][0].sum(dim=0).float()  # [query, key], summed over heads
    computed = np.setdiff1d(np.arange(exact, len(prompt)), pos)
    groups = {"computed": [computed], "last:4": [np.arange(len(prompt) - 4, len(prompt))]}
    groups["both:4"] = groups["computed"] + groups["last:4"]
    mass = sum(attention[torch.as_tensor(rows)].mean(dim=0) for rows in groups[queries])
    free = pos[pos >= exact]
    full = out.past_key_values.layers[4]
    error, norm = kv_error(model, src, (full.keys, full.values), free, old[pos >= exact], 4)
    score = error * mass[torch.as_tensor(free)]
    score[error < MIN_DEVIATION * norm] = -1.0
    want = math.ceil(0.3 * len(free))
    expected = np.sort(free[score.topk(want).indices.numpy()])
    assert len(chosen) == want and np.array_equal(chosen, expected)
    torch.testing.assert_close(fresh[4][0], full.keys, atol=2e-4, rtol=1e-4)  # layers 0..4: a prefill's
    others = [select(model, src, prompt, pos, old, exact, 0.3, 4, queries=q)[0] for q in groups if q != queries]
    assert all(not np.array_equal(chosen, other) for other in others)


@pytest.mark.parametrize("queries", ["", "last", "last:0", "first:4", "both:x", "computed:2"])
def test_queries_of_another_form_are_a_value_error(chat, queries) -> None:
    model, tok = chat
    prompt = np.asarray(render(tok, exchanges(1), None, ask=True))
    pos = np.arange(len(prompt))
    with pytest.raises(ValueError, match="queries must be"):
        select(model, None, prompt, pos, pos, 0, 0.3, 4, queries=queries)
