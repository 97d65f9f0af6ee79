"""The adapters' first module paths still name the same objects (existing vLLM configurations
and imports keep working after the adapters moved into one folder per engine)."""

from __future__ import annotations

import importlib

import pytest


@pytest.mark.parametrize(
    ("old", "new", "names"),
    [
        ("dss_adapters.vllm_connector", "dss_adapters.vllm.connector", ["DssConnector"]),
        (
            "dss_adapters.transformers_cache",
            "dss_adapters.transformers.cache",
            ["cache_from_pages", "cache_pages", "layout_for", "load_cache", "save_cache"],
        ),
        (
            "dss_adapters.transformers_cache",
            "dss_adapters.transformers.blend",
            ["BlendReport", "blend_cache", "blend_metrics"],
        ),
    ],
)
def test_the_first_module_path_names_the_same_objects(old: str, new: str, names: list[str]) -> None:
    pytest.importorskip("torch")
    before, after = importlib.import_module(old), importlib.import_module(new)
    assert set(names) <= set(before.__all__)
    for name in names:
        assert getattr(before, name) is getattr(after, name)


def test_the_transformers_path_exports_the_cache_and_the_blend() -> None:
    pytest.importorskip("torch")
    module = importlib.import_module("dss_adapters.transformers_cache")
    assert module.__all__ == [
        "BlendReport",
        "blend_cache",
        "blend_metrics",
        "cache_from_pages",
        "cache_pages",
        "layout_for",
        "load_cache",
        "save_cache",
    ]
