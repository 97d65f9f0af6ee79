"""The vLLM adapter: ``DssConnector`` (:mod:`dss_adapters.vllm.connector`), a V1 KV connector
on the attention load/save path, its scheduler and worker roles, and the demo."""
