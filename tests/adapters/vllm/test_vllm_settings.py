"""The connector's options (``kv_connector_extra_config``) and a request's dss scope."""

from __future__ import annotations

import pytest
from dss_adapters.vllm.settings import Scope, Settings, request_scope

import dss


def test_defaults_need_only_the_store() -> None:
    settings = Settings.from_extra_config({"store": "/var/dss"})
    assert settings == Settings(
        store="/var/dss",
        store_options={},
        namespace_source="request",
        default_tenant_id="default",
        default_user_id="anonymous",
        model_revision=None,
        page_bytes=None,
        load=True,
        save=True,
        max_pending_bytes=1 << 30,
        session_wait_s=5.0,
        load_mode="auto",
        recompute_tokens_per_s=None,
    )


def test_every_option_is_read() -> None:
    settings = Settings.from_extra_config(
        {
            "store": "/s",
            "store_options": {"host_bytes": "1GiB"},
            "namespace_source": "config",
            "default_tenant_id": "acme",
            "default_user_id": "svc",
            "model_revision": "r7",
            "page_bytes": 4096,
            "load": False,
            "save": False,
            "max_pending_bytes": 1024,
            "session_wait_s": 0,
            "load_mode": "async",
            "recompute_tokens_per_s": 400_000,
        }
    )
    assert settings == Settings(
        "/s", {"host_bytes": "1GiB"}, "config", "acme", "svc", "r7", 4096, False, False, 1024, 0.0, "async", 400_000.0
    )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (None, "needs 'store'"),
        ({"store": ""}, "needs 'store'"),
        ({"store": "/s", "stor": 1}, "unknown dss connector option(s) ['stor']"),
        ({"store": "/s", "namespace_source": "client"}, "'namespace_source' must be 'request' or 'config'"),
        ({"store": "/s", "page_bytes": 0}, "'page_bytes' must be a positive integer"),
        ({"store": "/s", "page_bytes": True}, "'page_bytes' must be a positive integer"),
        ({"store": "/s", "load": "yes"}, "'load' must be true or false"),
        ({"store": "/s", "session_wait_s": -1}, "'session_wait_s' must be a number of seconds >= 0"),
        ({"store": "/s", "default_user_id": ""}, "'default_user_id' must be a non-empty string"),
        ({"store": "/s", "store_options": [1]}, "'store_options' must be a mapping"),
        ({"store": "/s", "load_mode": "lazy"}, "'load_mode' must be 'auto', 'sync' or 'async', not 'lazy'"),
        ({"store": "/s", "recompute_tokens_per_s": 0}, "'recompute_tokens_per_s' must be a positive number"),
        ({"store": "/s", "recompute_tokens_per_s": True}, "'recompute_tokens_per_s' must be a positive number"),
        ({"store": "/s", "recompute_tokens_per_s": float("inf")}, "'recompute_tokens_per_s' must be a positive"),
    ],
)
def test_bad_options_are_config_errors(extra: dict | None, message: str) -> None:
    with pytest.raises(dss.ConfigError) as info:
        Settings.from_extra_config(extra)
    assert message in str(info.value)


def test_scope_from_request_params() -> None:
    settings = Settings.from_extra_config({"store": "/s"})
    params = {
        "dss": {"session_id": "chat-1", "tenant_id": "acme", "user_id": "u1", "label": "turn 3", "commit": False},
        "other_connector": {"x": 1},
    }
    assert request_scope(settings, params) == Scope("acme", "u1", "chat-1", "turn 3", False)
    assert request_scope(settings, None) == Scope("default", "anonymous", None, None, True)
    assert request_scope(settings, {"dss": {"user_id": "u2"}}) == Scope("default", "u2", None, None, True)


def test_config_namespace_ignores_what_requests_claim() -> None:
    settings = Settings.from_extra_config(
        {"store": "/s", "namespace_source": "config", "default_tenant_id": "acme", "default_user_id": "gateway"}
    )
    scope = request_scope(settings, {"dss": {"session_id": "c", "tenant_id": "evil", "user_id": "root"}})
    assert scope == Scope("acme", "gateway", "c", None, True)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"dss": "chat-1"}, "must be a mapping"),
        ({"dss": {"session": "c"}}, "unknown dss request field(s) ['session']"),
        ({"dss": {"session_id": 7}}, "'session_id' must be a string"),
        ({"dss": {"commit": "no"}}, "'commit' must be true or false"),
    ],
)
def test_malformed_request_fields_are_invalid_input(params: dict, message: str) -> None:
    with pytest.raises(dss.InvalidInput) as info:
        request_scope(Settings.from_extra_config({"store": "/s"}), params)
    assert message in str(info.value)


def test_page_movers_open_the_store_without_approximate_matching() -> None:
    """Workers and the reader process never resume: no LSH index is built in them at open."""
    settings = Settings.from_extra_config({"store": "/s", "store_options": {"approximate": True, "host_bytes": 5}})
    assert settings.store_options == {"approximate": True, "host_bytes": 5}
    assert settings.reader_options == {"approximate": False, "host_bytes": 5}
