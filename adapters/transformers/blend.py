"""Reuse past a divergence (opt-in, lossy): the KV of a prompt blended from its nearest stored
version, the way CacheBlend (EuroSys'25) does it, for Hugging Face transformers models.

Exact reuse stops at the first changed token. :func:`blend_cache` goes on: it takes the
stored version nearest the prompt (``Store.nearest``: the one the prompt holds most of), lines
the two up (the exact common prefix, then runs of equal tokens after the divergence), and
builds a ``DynamicCache`` for every position of the prompt:

* the exact prefix: the stored KV as is (exact);
* an aligned run after the divergence: the stored KV, keys re-rotated when the run moved
  (RoPE: ``R(p_new) k = R(p_new - p_old) R(p_old) k``), values as they are;
* layers ``0..select_layer``: computed now for every token after the exact prefix (exact),
  unless ``recompute`` is 0 or 1;
* everything else (the divergent and new tokens) and at most a share ``recompute`` of the
  reused tokens after the exact prefix: recomputed over just those tokens, attending to the
  kept KV, in the layers after ``select_layer`` (in every layer when ``recompute`` is 0 or
  1). The share is chosen at layer ``select_layer`` by the reused KV's error against the KV
  computed there (CacheBlend's deviation), weighted by the attention the prompt's last 8
  positions (the end of the new message and the generation prompt) pay to it there: a reused
  token's error reaches the answer only through the queries that attend to it
  (:mod:`dss_adapters.transformers.blend_select`; none whose error is under ``MIN_DEVIATION``
  of its squared norm).

Reused KV past the exact prefix was computed after *other* tokens, so the result is
approximate: :class:`BlendReport` says how much was reused, and :func:`blend_metrics` counts
it for the process. Nothing is reused approximately unless this function is called;
``recompute=1.0`` recomputes everything after the exact prefix (exact). For Llama-style models
with plain RoPE (no attention scaling), one sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from dss_adapters.transformers.blend_select import QUERIES, is_queries, layers_of, reused_kv, select
from dss_adapters.transformers.cache import load_cache

import dss
from dss import InvalidInput

DEFAULT_RECOMPUTE = 0.3
"""The most of the reused tokens recomputed by default (chosen from the table in the docs)."""
DEFAULT_SELECT_LAYER = 6
"""The layer whose KV deviation chooses the tokens to recompute (chosen from the table in the docs)."""
RUN_TOKENS = 8
"""Fewest tokens of an aligned run worth reusing."""

_TOTALS = {"blends": 0, "approximate_blends": 0, "reused_tokens": 0, "recomputed_tokens": 0, "exact_tokens": 0}


@dataclass(frozen=True)
class BlendReport:
    """What :func:`blend_cache` reused and recomputed for one prompt of ``num_tokens`` tokens."""

    num_tokens: int
    exact_prefix_tokens: int
    """Leading tokens whose stored KV is exact (same tokens at the same positions)."""
    reused_tokens: int
    """Tokens after the exact prefix whose stored KV was reused (approximate KV)."""
    recomputed_tokens: int
    """Tokens computed now: the divergent and new ones and the selected reused ones."""
    selected_tokens: int
    """Of ``recomputed_tokens``, those that could have been reused (the deviation rule's share)."""
    moved_tokens: int
    """Of ``reused_tokens``, those whose keys were re-rotated to a new position."""
    source_session: str | None
    source_version: int | None
    recompute: float
    runs: list[tuple[int, int, int]] = field(default_factory=list)
    """``(prompt position, stored position, length)`` of every aligned run reused."""

    @property
    def approximate(self) -> bool:
        """Whether any reused KV is approximate (computed after other tokens)."""
        return self.reused_tokens > 0


def blend_metrics() -> dict[str, int]:
    """This process's totals: blends, those that reused KV approximately, and their tokens."""
    return dict(_TOTALS)


def blend_cache(
    store: dss.Store,
    model: Any,
    tokens: list[int],
    layout: dss.Layout,
    *,
    session_id: str | None,
    tenant_id: str | None = None,
    user_id: str | None = None,
    recompute: float = DEFAULT_RECOMPUTE,
    select_layer: int = DEFAULT_SELECT_LAYER,
    queries: str = QUERIES,
) -> tuple[Any, BlendReport]:
    """A ``DynamicCache`` with KV for every position of ``tokens`` (ready for the next forward),
    built from the stored version nearest ``tokens`` in ``session_id``'s namespace (its own
    versions first; without a session, the namespace ``(tenant_id, user_id)``) and ``layout``,
    and its :class:`BlendReport`. See the module docstring.

    ``queries``: whose attention weighs a reused token's error (:data:`QUERIES`: the prompt's
    last 8 positions; ``"computed"``, ``"last:N"`` or ``"both:N"``).

    ``InvalidInput`` for empty tokens, ``recompute`` outside ``[0, 1]``, ``queries`` of another
    form, a ``layout`` that is not the session's or a model whose RoPE is scaled. Needs
    datasketch (``ConfigError``). Changes nothing in the store.
    """
    check(model, tokens, recompute, select_layer, queries)
    source = nearest(store, tokens, layout, session_id, tenant_id, user_id)
    prompt = np.asarray(tokens, np.int64)
    if source is None:
        src, stored, name, version = None, np.zeros(0, np.int64), None, None
    else:
        src, stored, name, version = source
    n_src = 0 if src is None else src.get_seq_length()
    exact = min(_common_prefix(prompt, stored), n_src)
    runs = aligned_runs(prompt, stored[:n_src], exact)
    pos, old = reused_positions(exact, runs)
    selected, fresh, hidden = select(model, src, prompt, pos, old, exact, recompute, select_layer, queries)
    cache = blended(model, src, prompt, pos, old, selected, fresh, hidden, exact)
    report = BlendReport(
        len(tokens),
        exact,
        int(len(pos) - exact - len(selected)),
        int(len(tokens) - len(pos) + len(selected)),
        len(selected),
        int(np.count_nonzero((pos != old) & ~np.isin(pos, selected))),
        name,
        version,
        recompute,
        runs,
    )
    count(report)
    return cache, report


def check(model: Any, tokens: list[int], recompute: float, select_layer: int, queries: str) -> None:
    if not tokens:
        raise InvalidInput("blend_cache needs at least one token")
    if isinstance(recompute, bool) or not isinstance(recompute, (int, float)) or not 0 <= recompute <= 1:
        raise InvalidInput(f"recompute must be a share from 0 to 1, got {recompute!r}")
    layers = model.config.get_text_config(decoder=True).num_hidden_layers
    if isinstance(select_layer, bool) or not isinstance(select_layer, int) or not 0 <= select_layer < layers:
        raise InvalidInput(f"select_layer must be a layer index from 0 to {layers - 1}, got {select_layer!r}")
    if not is_queries(queries):
        raise InvalidInput(f"queries must be 'computed', 'last:N' or 'both:N', got {queries!r}")
    if getattr(model.model.rotary_emb, "attention_scaling", 1.0) != 1.0:
        raise InvalidInput("blend_cache re-rotates keys, which needs RoPE without attention scaling")


def nearest(
    store: dss.Store,
    tokens: list[int],
    layout: dss.Layout,
    session_id: str | None,
    tenant_id: str | None,
    user_id: str | None,
) -> tuple[Any, np.ndarray, str, int] | None:
    """The stored KV (a ``DynamicCache`` of the version's stored pages), tokens, session and
    version of the stored version nearest ``tokens`` (``None``: nothing stored is near)."""
    if session_id is None:
        found = store.nearest(tokens, tenant_id=tenant_id, user_id=user_id, layout=layout, k=1)
    elif store.session(session_id, tenant_id=tenant_id).layout.digest != layout.digest:
        raise InvalidInput(f"layout is not the layout of session {session_id!r}")
    else:
        found = store.nearest(tokens, session_id=session_id, tenant_id=tenant_id, k=1)
    if not found:
        return None
    near = found[0]
    stored = store.tokens(near.session_id, near.version_id, tenant_id=tenant_id)
    result = store.resume(near.session_id, stored, tenant_id=tenant_id, approximate=False)
    if not result.matched_tokens:
        return None
    src, _ = load_cache(store, result, layout)
    return src, np.asarray(stored, np.int64), near.session_id, int(near.version_id)


def aligned_runs(prompt: np.ndarray, stored: np.ndarray, start: int) -> list[tuple[int, int, int]]:
    """Runs ``(i, j, n)`` of ``prompt[i:i+n] == stored[j:j+n]`` after ``start``, each at least
    :data:`RUN_TOKENS` long, in order in both (greedy: the first match of each window)."""
    size = RUN_TOKENS
    if len(stored) - start < size or len(prompt) - start < size:
        return []
    first: dict[bytes, int] = {}
    windows = np.lib.stride_tricks.sliding_window_view(stored, size)
    for j in range(len(windows) - 1, -1, -1):
        first[windows[j].tobytes()] = j
    probe = np.lib.stride_tricks.sliding_window_view(prompt, size)
    runs: list[tuple[int, int, int]] = []
    i, low = start, start
    while i < len(probe):
        j = first.get(probe[i].tobytes(), -1)
        if j < low:
            i += 1
            continue
        n = _common_prefix(prompt[i:], stored[j:])
        runs.append((i, j, n))
        i, low = i + n, j + n
    return runs


def reused_positions(exact: int, runs: list[tuple[int, int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """The prompt positions whose KV is reused, ascending, and the stored positions it comes from."""
    pos = [np.arange(exact)] + [np.arange(i, i + n) for i, _, n in runs]
    old = [np.arange(exact)] + [np.arange(j, j + n) for _, j, n in runs]
    return np.concatenate(pos).astype(np.int64), np.concatenate(old).astype(np.int64)


def blended(
    model: Any,
    src: Any,
    prompt: np.ndarray,
    pos: np.ndarray,
    old: np.ndarray,
    selected: np.ndarray,
    fresh: list[tuple[torch.Tensor, torch.Tensor]],
    hidden: torch.Tensor | None,
    exact: int,
) -> Any:
    """The cache of every position of ``prompt``: reused KV at ``pos`` but ``selected``, the
    rest computed attending to the kept KV (a mask by position). With ``fresh`` (the KV of
    layers ``0..L`` for every position) and ``hidden`` (layer ``L``'s output for every position
    from ``exact`` on), those layers are ``fresh`` and only layers ``L+1..`` run over the rest;
    otherwise one forward over the rest runs every layer."""
    from transformers import DynamicCache

    keep = ~np.isin(pos, selected)
    kept, kept_old = pos[keep], old[keep]
    todo = np.setdiff1d(np.arange(len(prompt)), kept)
    first = len(fresh) if hidden is not None else 0
    layers = reused_kv(model, src, kept, kept_old) if len(kept) else []
    if first:
        layers[:first] = [(k, v) for k, v in fresh]
    elif layers and fresh:
        at = torch.as_tensor(kept, device=model.device)
        layers[: len(fresh)] = [(k[:, :, at], v[:, :, at]) for k, v in fresh]
    cache = DynamicCache(layers) if layers else DynamicCache()
    if len(todo):
        _run_rest(model, cache, prompt, kept, todo, hidden if first else None, first, exact)
    order = torch.as_tensor(np.argsort(np.concatenate([kept, todo]), kind="stable"), device=model.device)
    out = layers_of(cache)
    return DynamicCache(out[:first] + [(k[:, :, order], v[:, :, order]) for k, v in out[first:]])


def _run_rest(
    model: Any,
    cache: Any,
    prompt: np.ndarray,
    kept: np.ndarray,
    todo: np.ndarray,
    hidden: torch.Tensor | None,
    first: int,
    exact: int,
) -> None:
    """Compute the KV of the positions ``todo`` of ``prompt`` into ``cache`` (holding the KV
    of ``kept``), each attending to the positions before it: layers ``first..`` from
    ``hidden`` (layer ``first - 1``'s output from ``exact`` on) when given, else one forward
    through every layer."""
    key_pos = torch.as_tensor(np.concatenate([kept, todo]), device=model.device)
    q_pos = torch.as_tensor(todo, device=model.device)
    mask = torch.zeros(1, 1, len(todo), len(key_pos), dtype=model.dtype, device=model.device)
    mask.masked_fill_(key_pos[None, :] > q_pos[:, None], torch.finfo(model.dtype).min)
    with torch.no_grad():
        if hidden is not None:
            states = hidden[:, torch.as_tensor(todo - exact, device=model.device)]
            turn = model.model.rotary_emb(states, position_ids=q_pos[None])
            for layer in model.model.layers[first:]:
                states = layer(
                    states,
                    attention_mask=mask,
                    position_embeddings=turn,
                    position_ids=q_pos[None],
                    past_key_values=cache,
                    use_cache=True,
                )
                states = states[0] if isinstance(states, tuple) else states
        else:
            model(
                torch.as_tensor(prompt[todo][None], device=model.device),
                position_ids=q_pos[None],
                attention_mask=mask,
                past_key_values=cache,
                use_cache=True,
            )


def count(report: BlendReport) -> None:
    _TOTALS["blends"] += 1
    _TOTALS["approximate_blends"] += report.approximate
    _TOTALS["reused_tokens"] += report.reused_tokens
    _TOTALS["recomputed_tokens"] += report.recomputed_tokens
    _TOTALS["exact_tokens"] += report.exact_prefix_tokens


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens two token arrays share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n
