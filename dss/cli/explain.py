"""``dss explain``: reading the prompt (ids or text) and printing an :class:`dss.approx.explanation.Explanation`."""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from typing import Any

from dss.approx.explanation import Explanation
from dss.core.errors import ConfigError, InvalidInput


def load_tokenizer(path: str) -> Any:
    """A Hugging Face ``tokenizers.Tokenizer`` from a tokenizer.json (no engine, no network)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError("--tokenizer needs the tokenizers package (pip install tokenizers)") from None
    try:
        return Tokenizer.from_file(path)
    except Exception as exc:  # noqa: BLE001 - the library raises bare Exceptions for a bad file
        raise InvalidInput(f"--tokenizer {path}: not a tokenizer.json ({exc})") from None


def read_prompt(args: tuple[str, ...], tokens_file: Any, text_file: Any, coder: Any) -> list[int]:
    """The prompt's token ids from exactly one of: arguments, ``--tokens-file``, ``--text-file``."""
    given = [bool(args), tokens_file is not None, text_file is not None]
    if sum(given) != 1:
        raise InvalidInput("give the prompt once: token ids as arguments, --tokens-file or --text-file")
    if text_file is not None:
        if coder is None:
            raise InvalidInput("--text-file needs --tokenizer")
        return list(coder.encode(text_file.read(), add_special_tokens=False).ids)
    text = " ".join(args) if args else tokens_file.read()
    if text.lstrip().startswith("["):
        try:
            ids = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidInput(f"the token file is not a JSON list: {exc.msg}") from None
    else:
        ids = [part for part in re.split(r"[\s,]+", text.strip()) if part]
    try:
        return [int(i) for i in ids]
    except (TypeError, ValueError):
        raise InvalidInput("token ids must be integers") from None


def explanation_json(why: Explanation) -> dict[str, Any]:
    out = asdict(why)
    out["nearest"] = why.nearest._asdict() if why.nearest is not None else None
    return out


def describe(why: Explanation) -> str:
    """The explanation as a few lines an operator reads."""
    lines = [
        f"prompt: {why.num_prompt_tokens} tokens; reused now: {why.matched_tokens}"
        + (f" (from {why.source})" if why.source else "")
    ]
    near = why.nearest
    if near is None:
        lines.append("nearest stored version: none in this namespace and layout")
        return "\n".join(lines)
    lines.append(
        f"nearest stored version: session {near.session_id!r} version {near.version_id} "
        f"({near.num_tokens} tokens), Jaccard {near.jaccard:.3f} (estimated {near.estimated_jaccard:.3f})"
    )
    if why.divergence is None:
        lines.append("no divergence: one is a prefix of the other")
        lines.append(f"reusable: {why.would_reuse_tokens} tokens")
        return "\n".join(lines)
    lines.append(f"first divergence: token {why.divergence}")
    cut = why.divergence - why.window_start
    for name, window, text in (
        ("prompt", why.prompt_window, why.prompt_text),
        ("stored", why.stored_window, why.stored_text),
    ):
        ids = " ".join(map(str, window[:cut])) + " | " + " ".join(map(str, window[cut:]))
        lines.append(f"  {name} [{why.window_start}:]: {ids}")
        if text is not None:
            lines.append(f"  {name} text: {text!r}")
    if why.resync_prompt is not None:
        lines.append(
            f"runs together again: prompt token {why.resync_prompt}, stored token {why.resync_stored}, "
            f"for {why.num_shared_after} tokens"
        )
    lines.append(f"without the divergence: {why.would_reuse_tokens} tokens reused ({why.lost_tokens} lost to it)")
    if why.recurring:
        lines.append(
            "recurring divergence positions (this process): " + ", ".join(f"{pos} ({n}x)" for pos, n in why.recurring)
        )
    return "\n".join(lines)
