"""Engine adapters for dss (installed as ``dss_adapters``): they use only the public ``dss`` API."""
