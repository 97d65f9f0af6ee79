"""The transformers adapter's public module path: :mod:`dss_adapters.transformers.cache` (pages
of a ``past_key_values`` cache) and :mod:`dss_adapters.transformers.blend` (reuse past a
divergence, opt-in and lossy)."""

from dss_adapters.transformers.blend import BlendReport, blend_cache, blend_metrics
from dss_adapters.transformers.cache import cache_from_pages, cache_pages, layout_for, load_cache, save_cache

__all__ = [
    "BlendReport",
    "blend_cache",
    "blend_metrics",
    "cache_from_pages",
    "cache_pages",
    "layout_for",
    "load_cache",
    "save_cache",
]
