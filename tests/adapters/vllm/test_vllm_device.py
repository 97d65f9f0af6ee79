"""The device tier in the real vLLM CPU engine: after a request finishes, the pages vLLM's
prefix cache still holds are reported on ``device`` (with this engine as their holder), the
next turn is served from vLLM's own cache (dss loads nothing), outputs stay exactly vLLM's,
and once vLLM lets the blocks go (or the engine shuts down) they are no longer on device.

The engine runs single-process, so its connector's store and this test's store share the
process's residency (:mod:`dss.tiers.device`). Conversation as in ``test_vllm_connector.py``
(block = page = 32 tokens): turn 1 (``p1``, 100 tokens, 40 generated) leaves KV of 139 tokens,
pages 0-3; turn 2 (``p2``, 170 tokens, 8 generated) leaves KV of 177 tokens, pages 0-4.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import dss
from tests.engines import conversation, engine, make_tiny_llama, run, tokens_out

SESSION = {"session_id": "chat-1", "tenant_id": "t", "user_id": "u"}


def held_once_saved(llm: object, store: dss.Store, pages: int) -> dict[str, int]:
    """The session's residency once it shows ``pages`` pages: the last pages of a request may
    still be on their way to the store when it finishes, and the connector looks for them again
    at the engine's next steps (here: steps of a short request dss does not serve)."""
    for _ in range(20):
        held = store.residency("chat-1", tenant_id="t")
        if sum(held.values()) >= pages:
            return held
        run(llm, [5] * 8, None, max_tokens=2)
    return store.residency("chat-1", tenant_id="t")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="module")
def ref(model: Path) -> dict[str, list[int]]:
    with engine(model, prefix_caching=False) as llm:
        return conversation(llm)


def test_pages_vllm_still_holds_are_on_device(
    model: Path, store_path: Path, sqlite_store: dss.Store, ref: dict[str, list[int]]
) -> None:
    store = sqlite_store
    history1 = ref["p1"] + ref["o1"]
    history2 = ref["p2"] + ref["o2"]
    with engine(model, store=store_path) as llm:
        first = run(llm, ref["p1"], SESSION, max_tokens=40)
        assert tokens_out(first) == ref["o1"]
        ((engine_id, held),) = held_once_saved(llm, store, 4).items()
        assert held == 4
        assert store.resume("chat-1", history1, tenant_id="t").tiers == {"device": 128}
        second = run(llm, ref["p2"], SESSION)
        assert tokens_out(second) == ref["o2"]
        assert second.num_cached_tokens == 128  # vLLM's own prefix cache
        assert second.kv_transfer_params["dss"]["loaded_tokens"] == 0  # dss loads nothing it holds
        assert held_once_saved(llm, store, 5) == {engine_id: 5}
        assert store.resume("chat-1", history2, tenant_id="t").tiers == {"device": 160}
        llm.reset_prefix_cache()  # vLLM lets every block go
        other = run(llm, ref["q"], None)  # a step of the engine, which notices
        assert tokens_out(other) == ref["oq"]
        assert store.residency("chat-1", tenant_id="t") == {}
        assert store.resume("chat-1", history2, tenant_id="t").tiers == {"disk": 160}
        third = run(llm, ref["p2"], {**SESSION, "commit": False})  # now dss loads the pages
        assert tokens_out(third) == ref["o2"]
        assert third.kv_transfer_params["dss"]["loaded_tokens"] == 160
        assert store.residency("chat-1", tenant_id="t") == {engine_id: 5}
    assert store.residency("chat-1", tenant_id="t") == {}  # the engine shut down
    assert store.check() == []
