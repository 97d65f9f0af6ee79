"""``scripts/gpu-check`` and its summary (``scripts/gpu-summary.py``), without a GPU.

The script's real work (wheels, an offline install, the gpu tests) needs the package index or a
GPU; here it must parse, answer ``--help`` with its usage, refuse bad arguments, and its summary
must count a pytest report exactly.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu-check"
SUMMARY = ROOT / "scripts" / "gpu-summary.py"

REPORT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="0" failures="1" skipped="2" tests="5">
<testcase classname="tests.adapters.test_staging" name="test_a[cuda]" file="tests/adapters/test_staging.py" time="0.1"/>
<testcase classname="tests.adapters.test_staging" name="test_b[cuda]" file="tests/adapters/test_staging.py" time="0.1">
  <skipped type="pytest.skip" message="needs a CUDA device">reason</skipped></testcase>
<testcase classname="tests.adapters.transformers.test_gpu_transformers" name="test_ttft" file="tests/adapters/transformers/test_gpu_transformers.py" time="2">
  <properties><property name="ttft_ms[recompute]" value="12.5"/></properties></testcase>
<testcase classname="tests.adapters.transformers.test_gpu_transformers" name="test_chat" file="tests/adapters/transformers/test_gpu_transformers.py" time="1">
  <failure message="assert 1 == 2">trace</failure></testcase>
<testcase classname="tests.adapters.vllm.test_vllm_gpu" name="test_v" file="tests/adapters/vllm/test_vllm_gpu.py" time="0">
  <skipped type="pytest.skip" message="Skipped: needs vLLM">reason</skipped></testcase>
</testsuite></testsuites>
"""


def test_the_script_parses_and_its_help_is_its_usage() -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    done = subprocess.run([str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stderr == ""
    assert done.stdout.startswith("Check dss on a CUDA machine:")
    assert "scripts/gpu-check --prepare DIR [--python-version X.Y]... [--arch ARCH]\n" in done.stdout
    assert "scripts/gpu-check [--install-only] [--venv PATH] [DIR]\n" in done.stdout
    assert "set -euo" not in done.stdout


def test_bad_arguments_are_refused_before_anything_is_done(tmp_path: Path) -> None:
    done = subprocess.run([str(SCRIPT), "--frobnicate"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stderr.endswith("gpu-check: FAILED: unknown option --frobnicate\n")
    done = subprocess.run([str(SCRIPT), "--prepare"], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (1, "gpu-check: FAILED: --prepare needs a folder\n")
    done = subprocess.run([str(SCRIPT), "a", "b"], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (1, "gpu-check: FAILED: one wheel folder, not two (a, b)\n")


def test_a_python_without_torch_and_transformers_is_refused_first(tmp_path: Path) -> None:
    done = subprocess.run(
        [str(SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHON": "false"}
    )
    assert (done.returncode, done.stderr) == (1, "gpu-check: FAILED: false has no usable torch and transformers\n")


def test_the_summary_counts_each_file_and_says_why_tests_were_skipped(tmp_path: Path) -> None:
    (tmp_path / "gpu.xml").write_text(REPORT)
    (tmp_path / "unrunnable").write_text("tests/adapters/vllm/test_vllm_worker.py\tvllm\n")
    done = subprocess.run(
        [sys.executable, str(SUMMARY), str(tmp_path / "gpu.xml"), str(tmp_path / "unrunnable")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1  # a test failed
    assert done.stdout.splitlines() == [
        "summary of the gpu tests:",
        "  tests/adapters/test_staging.py: 1 passed, 1 skipped",
        "      skipped 1: needs a CUDA device",
        "  tests/adapters/transformers/test_gpu_transformers.py: 1 passed, 1 failed",
        "  tests/adapters/vllm/test_vllm_gpu.py: 1 skipped",
        "      skipped 1: needs vLLM",
        "  tests/adapters/vllm/test_vllm_worker.py: not run (its imports need vllm, which is not installed)",
        "measured:",
        "  test_ttft: ttft_ms[recompute] = 12.5",
        "gpu-check: 2 passed, 1 failed, 2 skipped",
    ]


def test_without_a_report_the_summary_says_nothing_ran(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(SUMMARY), str(tmp_path / "none.xml"), str(tmp_path / "none")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0
    assert done.stdout == "summary of the gpu tests:\ngpu-check: 0 passed, 0 failed, 0 skipped\n"
