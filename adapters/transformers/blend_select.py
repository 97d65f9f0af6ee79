"""Which reused tokens a blend recomputes (:mod:`dss_adapters.transformers.blend`): the reused
KV read from the stored cache (moved keys re-rotated), its error against KV computed now, and
the attention that the prompt's last positions pay to it.
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np
import torch

MIN_DEVIATION = 1e-4
"""A reused token whose KV deviates less than this (squared error over the squared norm, keys
and values, at the selecting layer) is not recomputed: a re-rendered line leaves most tokens
after it under 1e-4, a dropped exchange most over 3e-4 (SmolLM2, layer 4)."""


def rotation(model: Any, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's cosines and sines (float32, ``[1, 1, n, dim]``) that turn keys by ``delta`` positions each."""
    x = torch.zeros(1, 1, dtype=torch.float32, device=model.device)
    cos, sin = model.model.rotary_emb(x, delta[None].to(model.device))
    return cos[:, None], sin[:, None]


def rerotate(keys: torch.Tensor, turn: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``keys`` (``[1, heads, n, dim]``, rotated at their old positions) turned by :func:`rotation`
    (float32 inside, the keys' dtype out)."""
    cos, sin = turn
    k = keys.float()
    half = k.shape[-1] // 2
    return (k * cos + torch.cat((-k[..., half:], k[..., :half]), dim=-1) * sin).to(keys.dtype)


def layers_of(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The keys and values of every layer of a ``DynamicCache``."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def reused_kv(
    model: Any, src: Any, pos: np.ndarray, old: np.ndarray, only: int | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's (or layer ``only``'s) stored keys and values at ``old``, keys moved to ``pos``."""
    index = torch.as_tensor(old, device=model.device)
    delta = torch.as_tensor(pos - old, device=model.device)
    turn = rotation(model, delta) if bool((delta != 0).any()) else None
    layers = layers_of(src)
    out = []
    for keys, values in layers if only is None else layers[only : only + 1]:
        keys, values = keys[:, :, index], values[:, :, index]
        out.append((rerotate(keys, turn) if turn is not None else keys, values))
    return out


def is_queries(queries: object) -> bool:
    """Whether ``queries`` has one of :data:`QUERIES`' forms."""
    return queries == "computed" or (
        isinstance(queries, str) and re.fullmatch(r"(last|both):[1-9][0-9]*", queries) is not None
    )


def query_groups(queries: str, length: int, pos: np.ndarray, exact: int) -> list[np.ndarray]:
    """The groups of query rows (positions less ``exact``) that :data:`QUERIES`' form ``queries``
    names for a prompt of ``length`` whose reused positions are ``pos``: the divergent and new
    tokens (the last position when there are none), the last ``N`` positions, or both."""
    kind, _, n = queries.partition(":")
    computed = np.setdiff1d(np.arange(exact, length), pos)
    rows = (computed if len(computed) else np.array([length - 1])) - exact
    last = np.arange(max(exact, length - int(n or 1)), length) - exact
    return [rows] if kind == "computed" else [last] if kind == "last" else [rows, last]


class _Stop(Exception):
    pass


QUERIES = "last:8"
"""Whose attention weighs a reused token's error: ``last:N`` (the prompt's last ``N`` positions:
the end of the new message and the generation prompt, whose queries make the answer),
``computed`` (the divergent and new tokens) or ``both:N`` (the two groups, each averaged over
its queries). ``last:8`` was chosen on real conversations (docs/approximate.md): two misses at
the prompt's end of 60 against ``computed``'s four where it was chosen, none for either on the
turns held out."""

QUERY_CHUNK = 256
"""Queries whose attention is weighed at once (bounds the memory of :func:`attention_mass`)."""


def kv_error(
    model: Any, src: Any, fresh: tuple[torch.Tensor, torch.Tensor], free: np.ndarray, old: np.ndarray, layer: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position of ``free``: the squared error of its reused KV (stored at ``old``, keys
    moved) against ``fresh`` at ``layer``, keys and values together, and the fresh KV's squared
    norm (float32)."""
    fresh_k, fresh_v = fresh
    ((keys, values),) = reused_kv(model, src, free, old, only=layer)
    at = torch.as_tensor(free, device=model.device)
    fk, fv = fresh_k[:, :, at].float(), fresh_v[:, :, at].float()
    error = (fk - keys.float()).pow(2).sum(dim=(0, 1, 3)) + (fv - values.float()).pow(2).sum(dim=(0, 1, 3))
    return error, fk.pow(2).sum(dim=(0, 1, 3)) + fv.pow(2).sum(dim=(0, 1, 3))


def attention_mass(
    model: Any, layer: int, seen: dict[str, Any], keys: torch.Tensor, rows: np.ndarray, start: int
) -> torch.Tensor:
    """The attention that the queries of prompt positions ``start + rows`` pay each key position
    at ``layer``, summed over them and every head (float32). ``seen``: the attention's inputs
    in the forward that ran from ``start`` (``hidden_states``, ``position_embeddings``);
    ``keys``: that layer's keys of every position."""
    attn = model.model.layers[layer].self_attn
    cos, sin = seen["position_embeddings"]
    key_pos = torch.arange(keys.shape[2], device=model.device)
    k = keys.float().repeat_interleave(attn.config.num_attention_heads // keys.shape[1], dim=1)
    mass = torch.zeros(keys.shape[2], dtype=torch.float32, device=model.device)
    for n in range(0, len(rows), QUERY_CHUNK):
        at = torch.as_tensor(rows[n : n + QUERY_CHUNK], device=model.device)
        with torch.no_grad():
            q = attn.q_proj(seen["hidden_states"][:, at]).view(1, len(at), -1, attn.head_dim).transpose(1, 2)
        q = rerotate(q, (cos[:, at][:, None].float(), sin[:, at][:, None].float())).float()
        logits = (q @ k.transpose(-1, -2)) * attn.scaling
        logits.masked_fill_(key_pos[None, :] > (at + start)[:, None], float("-inf"))
        mass += logits.softmax(-1).sum(dim=(0, 1, 2))
    return mass


def select(
    model: Any,
    src: Any,
    prompt: np.ndarray,
    pos: np.ndarray,
    old: np.ndarray,
    exact: int,
    share: float,
    layer: int,
    queries: str = QUERIES,
) -> tuple[np.ndarray, list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor | None]:
    """The reused positions to recompute (at most ``share`` of those after the exact prefix),
    the KV of layers ``0..layer`` computed now for every position, and the output of ``layer``
    for every position from ``exact`` on (a share of 0 or 1 runs nothing: no KV, ``None``).

    A prefill runs layers ``0..layer`` over the prompt after the exact prefix, attending to it.
    At ``layer``, each reused token's KV is compared with the fresh one (squared error of keys
    and values); the error counts as much as the ``queries`` (:data:`QUERIES`) attend to it
    there (their attention, summed over heads, averaged over the queries: the attention-weighted
    deviation; ``computed`` without divergent or new tokens: the last position). The tokens that
    score highest are chosen, none whose error is under :data:`MIN_DEVIATION` of the fresh KV's
    squared norm. A ``queries`` of another form is a ``ValueError``."""
    if not is_queries(queries):
        raise ValueError(f"queries must be 'computed', 'last:N' or 'both:N', not {queries!r}")
    free = pos[pos >= exact]
    want = math.ceil(share * len(free))
    if not want or src is None:
        return np.zeros(0, np.int64), [], None
    if want >= len(free):
        return free, [], None
    from transformers import DynamicCache

    prefix = DynamicCache([(k[:, :, :exact], v[:, :, :exact]) for k, v in layers_of(src)]) if exact else DynamicCache()
    seen: dict[str, Any] = {}

    def look(_: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        seen.update(kwargs)

    def stop(_: Any, args: tuple, output: Any) -> None:
        seen["output"] = output[0] if isinstance(output, tuple) else output
        raise _Stop

    hooks = (
        model.model.layers[layer].self_attn.register_forward_pre_hook(look, with_kwargs=True),
        model.model.layers[layer].register_forward_hook(stop),
    )
    ids = torch.as_tensor(prompt[exact:][None], device=model.device)
    try:
        with torch.no_grad():
            model(ids, past_key_values=prefix, use_cache=True)
    except _Stop:
        pass
    finally:
        for hook in hooks:
            hook.remove()
    fresh = layers_of(prefix)[: layer + 1]
    error, norm = kv_error(model, src, fresh[layer], free, old[pos >= exact], layer)
    mass = torch.zeros(len(prompt), dtype=torch.float32, device=model.device)
    for group in query_groups(queries, len(prompt), pos, exact):
        mass += attention_mass(model, layer, seen, fresh[layer][0], group, exact) / len(group)
    score = error * mass[torch.as_tensor(free, device=model.device)]
    score[error < MIN_DEVIATION * norm.clamp_min(1e-12)] = -1.0
    top = torch.topk(score, want)
    chosen = top.indices[top.values >= 0].cpu().numpy()
    return np.sort(free[chosen]), fresh, seen["output"]
