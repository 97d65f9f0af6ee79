"""The transformers adapter: a ``DynamicCache`` loaded from and saved to a store
(:mod:`dss_adapters.transformers.cache`)."""
