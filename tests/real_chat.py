"""A real conversation on SmolLM2-135M-Instruct for the transformers adapter tests.

The model is the real one (:func:`dss_adapters.models.smollm2`, the ``smollm2_model`` fixture);
prompts are rendered with its ChatML template and tokenized by its tokenizer. A chat backend
that keeps tokens appends each turn to the tokens it already has (the answer exactly as
generated), so :func:`next_turn` does the same rather than re-rendering the whole conversation.

The oracles, and why (bf16 rounding, see the SmolLM2 notes): a prefix computed in a separate
step rounds differently from one computed in the same step. So in bf16 a restored cache is
compared with *the same split done without dss* — the cache turn 1 left in memory, cut to the
tokens dss restored (:func:`prefix_of`); only in float32 is it compared with one full forward
over the whole prompt (no cache at all).

Imported by the adapter test modules (not a conftest); transformers is imported lazily.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from dss_adapters.staging import StagingPool
from dss_adapters.transformers.cache import layout_for, load_cache, save_cache

import dss

SYSTEM = (
    "You are a concise assistant for a team that runs language model inference servers. "
    "Answer in plain sentences, without lists, and keep every answer short."
)
QUESTION = (
    "We keep the key and value tensors of every conversation so that the next turn does not have to "
    "compute the whole prompt again. Our servers have GPU memory, host memory, local disks and a shared "
    "network store. First a quick question: what is the capital of France? Answer in one sentence."
)
FOLLOW_UP = (
    "Thank you. Now, in one sentence: why would loading stored key and value tensors from host "
    "memory be faster than computing them again for a long prompt?"
)
LONG_PARAGRAPH = (
    "Section {n}. The operator keeps a log of every request: the time it arrived, the session it "
    "belongs to, how many tokens of its prompt were already stored, which tier they came from, "
    "and how long the first token took. Each week the log is summarised for the capacity plan. "
)


def load(path: Path, dtype: torch.dtype, device: str = "cpu") -> tuple[Any, Any]:
    """The model (in ``dtype`` on ``device``, eval mode) and its tokenizer from the folder ``path``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    return model, AutoTokenizer.from_pretrained(path)


def encode(tokenizer: Any, text: str) -> list[int]:
    """The token ids of ``text`` as it stands (template markers included), no special tokens added."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def first_turn(tokenizer: Any, question: str = QUESTION) -> list[int]:
    """The system prompt and ``question`` rendered with the chat template, ready for the answer."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return encode(tokenizer, tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def next_turn(tokenizer: Any, history: list[int], text: str = FOLLOW_UP) -> list[int]:
    """``history`` (a prompt and its answer as generated) closed, then the user's ``text``, ready for the answer."""
    closed = "" if history and history[-1] == tokenizer.eos_token_id else "<|im_end|>"
    return history + encode(tokenizer, f"{closed}\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")


def long_history(tokenizer: Any, num_tokens: int) -> list[int]:
    """A first turn whose user message is a long log description, cut to exactly ``num_tokens`` tokens."""
    text = "".join(LONG_PARAGRAPH.format(n=n) for n in range(1, num_tokens // 40 + 2))
    tokens = first_turn(tokenizer, text)
    assert len(tokens) >= num_tokens, "the long text is too short for the tokens asked"
    return tokens[:num_tokens]


def greedy(model: Any, tokens: list[int], num_new: int, cache: Any = None) -> Any:
    """Greedy generation of ``num_new`` tokens after ``tokens`` (continuing ``cache`` if given, which it extends)."""
    ids = torch.tensor([tokens], device=model.device)
    with torch.no_grad():
        return model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            past_key_values=cache,
            max_new_tokens=num_new,
            do_sample=False,
            return_dict_in_generate=True,
            pad_token_id=0,
        )


def answer(output: Any, prompt: list[int]) -> list[int]:
    """The tokens ``greedy`` generated after ``prompt``."""
    return list(output.sequences[0].tolist()[len(prompt) :])


def prefix_of(cache: Any, num_tokens: int) -> Any:
    """A new ``DynamicCache`` holding copies of the first ``num_tokens`` tokens of ``cache`` (unchanged)."""
    from transformers import DynamicCache

    return DynamicCache(
        [(layer.keys[:, :, :num_tokens].clone(), layer.values[:, :, :num_tokens].clone()) for layer in cache.layers]
    )


def same_tensors(a: Any, b: Any) -> bool:
    """Whether two caches hold the same layers, bit for bit (same shapes, dtypes and devices)."""
    return len(a.layers) == len(b.layers) and all(
        torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values) and x.keys.device == y.keys.device
        for x, y in zip(a.layers, b.layers)
    )


@dataclass
class Chat:
    """Two turns of the real chat, the second one's cache restored out of the store."""

    prompt1: list[int]
    turn1: Any
    """Turn 1's ``generate`` output (its ``past_key_values`` is the cache turn 1 left in memory)."""
    turn2: list[int]
    cache: Any
    """Turn 2's cache, restored from the pages of turn 1."""
    num_cached: int


def through_the_store(
    model: Any, tokenizer: Any, store: dss.Store, store_path: Path, *, staging: StagingPool | None = None
) -> Chat:
    """Turn 1 of the real chat (greedy), its cache saved to session ``chat-1`` and committed; turn 2's
    cache restored by a fresh handle on the store's folder (its host tier is empty: from disk),
    onto the model's device (through ``staging`` if given). Asserts what the store reports."""
    layout = layout_for(model, page_tokens=32)
    store.create_session("chat-1", user_id="u", tenant_id="t", layout=layout)
    prompt1 = first_turn(tokenizer)
    turn1 = greedy(model, prompt1, 24)
    history = turn1.sequences[0].tolist()
    num_pages = (len(history) - 1) // 32  # the cache holds every token but the last generated one
    assert save_cache(store, turn1.past_key_values, history, layout, session_id="chat-1", tenant_id="t") == num_pages
    store.commit("chat-1", history, tenant_id="t")
    turn2 = next_turn(tokenizer, history)
    with dss.open(store_path) as fresh:
        result = fresh.resume("chat-1", turn2, tenant_id="t")
        assert (result.matched_tokens, result.tiers) == (num_pages * 32, {"disk": num_pages * 32})
        cache, num_cached = load_cache(
            fresh, result, layout, limit=len(turn2) - 1, device=model.device, staging=staging
        )
    assert num_cached == cache.get_seq_length() == num_pages * 32
    return Chat(prompt1, turn1, turn2, cache, num_cached)
