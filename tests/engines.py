"""Real engines for the adapter tests: vLLM (CPU build) around SmolLM2-135M-Instruct (real
weights) or a tiny random-weight Llama.

Nothing here is a mock. :func:`engine` starts a real ``vllm.LLM``, single-process by default
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, about 10 s to start on 2 cores) or in vLLM's default
multi-process mode (about 30 s). Prompts are token ids (``TokensPrompt``); the engine has no
tokenizer of its own.

- SmolLM2 (``smollm2_model`` in ``conftest``): conversations are rendered by the model's own
  chat template (:func:`chat_tokenizer`, :func:`render`, :func:`reply`). Its greedy outputs
  in bf16 depend on how a prompt is split into a cached prefix and a computed suffix, so a
  bf16 oracle is vLLM's own prefix cache with the same split; against no cache at all,
  compare in float32 (``dtype="float32"``, which casts the bf16 weights).
- :func:`make_tiny_llama` writes a real Hugging Face checkpoint with random weights (std
  0.2), for the shapes SmolLM2 lacks (heads that split over 2 tensor-parallel ranks, sliding
  windows, hybrids) and tests of exact tiny shapes.

Imported by the adapter test modules (not a conftest, so it stays independent of the core
suite's fixtures).
"""

from __future__ import annotations

import gc
import os
import struct
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

VOCAB = 512
BLOCK = 32
"""vLLM block size = dss page size in these tests (CPU attention needs a multiple of 32)."""
CONNECTOR = "DssConnector"
CONNECTOR_MODULE = "dss_adapters.vllm.connector"


def make_tiny_llama(path: Path, *, seed: int = 0, sliding_window: int | None = None) -> Path:
    """Write a 2-layer Llama (hidden 128, 4 heads of 32, 2 KV heads, vocab 512, fp32) to ``path``.

    With ``sliding_window``, 4 layers alternating full and sliding-window attention of that
    many tokens (``layer_types``, as Mistral-style configs have it; vLLM runs them as two KV
    cache groups). Weights are drawn from N(0, 0.2) with ``seed``, so the same seed gives the
    same model. Returns ``path``.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    layers = 2 if sliding_window is None else 4
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    if sliding_window is not None:
        cfg.layer_types = ["full_attention", "sliding_attention"] * 2
        cfg.sliding_window = sliding_window
    return _save_random(LlamaForCausalLM, cfg, path, seed)


def make_tiny_hybrid(path: Path, *, seed: int = 0) -> Path:
    """Write a 4-layer Granite 4 style hybrid (Mamba-2 layers 0 and 2, attention layers 1 and 3;
    hidden 128, fp32), which the vLLM CPU build runs. Returns ``path``.

    Its Mamba layers keep a long memory (``A_log`` = -8: a state decays by about 0.1% a
    token), so that outputs hundreds of tokens later still depend on a stored state (with
    random ``A_log`` a state fades within ten tokens, and a wrong one would go unnoticed).
    """
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    cfg = GraniteMoeHybridConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        shared_intermediate_size=256,
        num_local_experts=0,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_types=["mamba", "attention", "mamba", "attention"],
        mamba_n_heads=4,
        mamba_d_head=32,
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=1,
        mamba_chunk_size=32,
        position_embedding_type="rope",
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    return _save_random(GraniteMoeHybridForCausalLM, cfg, path, seed, long_memory=True)


def _save_random(model_class: Any, cfg: Any, path: Path, seed: int, *, long_memory: bool = False) -> Path:
    """A model of ``cfg`` with weights from N(0, 0.2) (seeded), saved to ``path``; with
    ``long_memory``, every Mamba ``A_log`` is -8 (see :func:`make_tiny_hybrid`)."""
    import torch

    torch.manual_seed(seed)
    model = model_class(cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.2)
            if long_memory and name.endswith("A_log"):
                param.fill_(-8.0)
    model.save_pretrained(path)
    return path


def prompt(seed: int, n: int) -> list[int]:
    """``n`` token ids in ``[3, VOCAB)`` (no special tokens), the same for the same seed."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def chat_tokenizer(model: Path) -> Any:
    """The Hugging Face tokenizer of a real model's folder, with its chat template."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model))


def render(tokenizer: Any, messages: Sequence[Mapping[str, str]]) -> list[int]:
    """The token ids of ``messages`` rendered by the model's chat template and ending with the
    assistant's generation prompt, as vLLM's chat API renders them (text, then tokens without
    added special tokens)."""
    text = tokenizer.apply_chat_template([dict(m) for m in messages], tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def reply(tokenizer: Any, token_ids: Sequence[int]) -> dict[str, str]:
    """The assistant message of a reply's token ids (special tokens dropped), for the next turn."""
    return {"role": "assistant", "content": tokenizer.decode(list(token_ids), skip_special_tokens=True)}


def dss_config(store: Path, **extra: Any) -> dict[str, Any]:
    """A ``kv_transfer_config`` that loads the dss connector on ``store``."""
    return {
        "kv_connector": CONNECTOR,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"store": str(store), **extra},
    }


@contextmanager
def engine(
    model: Path,
    *,
    store: Path | None = None,
    dtype: str = "float32",
    multiprocess: bool = False,
    prefix_caching: bool = True,
    max_num_batched_tokens: int = 2048,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    max_num_seqs: int = 4,
    num_blocks: int | None = None,
    max_model_len: int = 2048,
    log_stats: bool = False,
    block_size: int | None = BLOCK,
    gpu_memory_utilization: float = 0.9,
    **extra: Any,
) -> Iterator[Any]:
    """A ``vllm.LLM`` on ``model`` in ``dtype`` (block 32 unless ``block_size`` says otherwise;
    ``None``: vLLM's choice), without a tokenizer, with the dss connector on ``store`` if given
    (``extra`` goes to its ``kv_connector_extra_config``). Shut down on exit, so the next
    engine of this process is a fresh one.

    Parallel engines run in vLLM's multi-process mode with one core per rank
    (``VLLM_CPU_OMP_THREADS_BIND``); pipeline parallelism runs compiled, because the CPU
    build's eager mode never sets up the later stages' input buffers (a vLLM 0.32 bug: the
    first request fails in ``sync_and_gather_intermediate_tensors``). ``num_blocks`` caps
    the KV cache (to force preemption); ``log_stats`` turns on vLLM's stats (metrics).
    """
    world = tensor_parallel_size * pipeline_parallel_size
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess or world > 1 else "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    bind = os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    if world > 1:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(core % (os.cpu_count() or 1)) for core in range(world))
    from vllm import LLM

    try:
        llm = LLM(
            model=str(model),
            dtype=dtype,
            enforce_eager=pipeline_parallel_size == 1,
            max_model_len=max_model_len,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            seed=0,
            skip_tokenizer_init=True,
            enable_prefix_caching=prefix_caching,
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            num_gpu_blocks_override=num_blocks,
            disable_log_stats=not log_stats,
            gpu_memory_utilization=gpu_memory_utilization,
            kv_transfer_config=dss_config(store, **extra) if store is not None else None,
        )
    finally:
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        if bind is not None:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def generate(
    llm: Any,
    prompts: Sequence[Sequence[int]],
    *,
    max_tokens: int = 8,
    params: Sequence[dict[str, Any] | None] | None = None,
) -> list[Any]:
    """Greedy completions of token-id prompts; ``params[i]`` is request i's ``kv_transfer_params``.

    Returns vLLM's ``RequestOutput`` objects in prompt order.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sampling = []
    for i in range(len(prompts)):
        extra = {"kv_transfer_params": params[i]} if params is not None and params[i] is not None else None
        sampling.append(
            SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False, extra_args=extra)
        )
    inputs = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
    return llm.generate(inputs, sampling, use_tqdm=False)


def run(llm: Any, tokens: list[int], fields: dict[str, Any] | None, max_tokens: int = 8) -> Any:
    """One greedy request whose ``kv_transfer_params`` are ``{"dss": fields}`` (none if ``None``)."""
    return generate(llm, [tokens], max_tokens=max_tokens, params=[{"dss": fields} if fields is not None else None])[0]


def conversation(llm: Any) -> dict[str, list[int]]:
    """The prompts of the engine tests and their greedy outputs on ``llm`` (an engine without dss)::

    p1  = 100 prompt tokens                      -> o1: 40 tokens
    p2  = p1 + o1 + 30 new tokens  (170 tokens)  -> o2: 8 tokens
    p2b = p1 + o1 + 25 other tokens (165 tokens) -> o2b: 8 tokens
    q   = 70 tokens                              -> oq: 8 tokens
    """
    out: dict[str, list[int]] = {"p1": prompt(1, 100), "q": prompt(4, 70)}
    out["o1"] = tokens_out(generate(llm, [out["p1"]], max_tokens=40)[0])
    out["p2"] = out["p1"] + out["o1"] + prompt(2, 30)
    out["p2b"] = out["p1"] + out["o1"] + prompt(3, 25)
    o2, o2b, oq = generate(llm, [out["p2"], out["p2b"], out["q"]])
    out["o2"], out["o2b"], out["oq"] = tokens_out(o2), tokens_out(o2b), tokens_out(oq)
    return out


def two_turns(
    model: Path,
    store: Path,
    ref: dict[str, list[int]],
    fields: dict[str, Any],
    first_engine: dict[str, Any] | None = None,
    **engine_args: Any,
) -> tuple[Any, Any]:
    """Turn 1 (``p1``, 40 tokens) in an engine with dss on ``store``, then turn 2 (``p2``) in a
    fresh one (whose worker holds no page in RAM): their outputs. ``engine_args`` go to both
    engines, ``first_engine`` to the first only."""
    with engine(model, store=store, **engine_args, **(first_engine or {})) as llm:
        first = run(llm, ref["p1"], fields, max_tokens=40)
    with engine(model, store=store, **engine_args) as llm:
        return first, run(llm, ref["p2"], fields)


def turn_two_twice(llm: Any, ref: dict[str, list[int]], fields: dict[str, Any]) -> tuple[Any, Any]:
    """Turn 2 (``p2``) in ``fields``'s session, then the same again with vLLM's own prefix cache
    emptied and nothing committed: what a load that failed left for the next request."""
    out = run(llm, ref["p2"], fields)
    llm.reset_prefix_cache()
    return out, run(llm, ref["p2"], {**fields, "commit": False})


def tokens_out(output: Any) -> list[int]:
    """The generated token ids of one ``RequestOutput``."""
    return list(output.outputs[0].token_ids)


def corrupt_page(store_path: Path, page_id: bytes) -> None:
    """Flip one payload byte of the page's record in its segment file (format ``dss-segment v1``:
    a 32-byte header, then records of page id (16) | length u32 | flags u32 | XXH3 i64, payload)."""
    record = struct.Struct("<16sIIq")
    for path in sorted((store_path / "segments").glob("*.seg")):
        data = bytearray(path.read_bytes())
        offset = 32
        while offset < len(data):
            found, length, _, _ = record.unpack_from(data, offset)
            if found == page_id:
                data[offset + record.size + 7] ^= 0xFF
                path.write_bytes(bytes(data))
                return
            offset += record.size + length
    raise AssertionError(f"page {page_id.hex()} is in no segment file")
