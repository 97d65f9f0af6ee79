"""The transformers adapter's first module path, kept so existing imports work: it is
:mod:`dss_adapters.transformers.cache`."""

from dss_adapters.transformers.cache import cache_from_pages, cache_pages, layout_for, load_cache, save_cache

__all__ = ["cache_from_pages", "cache_pages", "layout_for", "load_cache", "save_cache"]
