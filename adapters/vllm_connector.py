"""The connector's first module path, kept so existing ``kv_connector_module_path`` settings
work: it is :mod:`dss_adapters.vllm.connector`."""

from dss_adapters.vllm.connector import DssConnector

__all__ = ["DssConnector"]
