"""Property-based fuzzing of the HTTP API from its own OpenAPI document (Schemathesis).

For every operation, Schemathesis generates requests from the schema — valid ones and
ones that break it — with an admin key, and checks each answer: never a 5xx, status code,
content type, headers and body as documented, and schema-breaking requests refused with a
4xx. The number of examples is bounded (``FUZZ_EXAMPLES`` per operation) so the run stays
within seconds; the store behind the app is real and keeps what the fuzzer commits.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import checks as st_checks

import dss
from dss.service.apikeys import KeyRing, add_key
from dss.service.config import load_server_config
from dss.service.server import create_app

FUZZ_EXAMPLES = 40
LAYOUT = dss.Layout(name="fuzz", page_tokens=2, page_bytes=4)

CHECKS = [
    st_checks.not_a_server_error,
    st_checks.status_code_conformance,
    st_checks.content_type_conformance,
    st_checks.response_schema_conformance,
    st_checks.response_headers_conformance,
    st_checks.negative_data_rejection,
]


@pytest.fixture(scope="module")
def fuzz_target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, str, dss.Store]]:
    home: Path = tmp_path_factory.mktemp("fuzz")
    key, _ = add_key(home / "api-keys.json", "fuzz", is_admin=True)
    store = dss.open(home, fsync=False)
    store.create_session("s", user_id="fuzz-user-1", tenant_id="fuzz", layout=LAYOUT)
    store.commit("s", [1, 2, 3, 4, 5], {0: b"abcd", 1: b"efgh"}, tenant_id="fuzz")
    config = load_server_config(home, max_body_bytes=1 << 20, max_tokens=4096)
    app = create_app(store, config, KeyRing(config.keys_file))
    yield app, key, store
    store.close()


@pytest.fixture(scope="module")
def api_schema(fuzz_target: tuple[Any, str, dss.Store]) -> Any:
    app, _, _ = fuzz_target
    return schemathesis.openapi.from_asgi("/openapi.json", app)


OPERATIONS = [
    ("GET", "/healthz"),
    ("GET", "/metrics"),
    ("GET", "/v1/info"),
    ("POST", "/v1/sessions"),
    ("GET", "/v1/sessions"),
    ("GET", "/v1/session"),
    ("DELETE", "/v1/session"),
    ("GET", "/v1/versions"),
    ("GET", "/v1/tokens"),
    ("POST", "/v1/commit"),
    ("POST", "/v1/pages"),
    ("POST", "/v1/pages/read"),
    ("POST", "/v1/resume"),
    ("POST", "/v1/lookup"),
    ("POST", "/v1/nearest"),
    ("POST", "/v1/explain"),
    ("POST", "/v1/rollback"),
    ("POST", "/v1/branch"),
    ("POST", "/v1/pin"),
    ("POST", "/v1/sql"),
    ("GET", "/v1/check"),
    ("GET", "/v1/stats"),
    ("POST", "/v1/forget_user"),
    ("GET", "/v1/audit"),
    ("POST", "/v1/prefetch"),
    ("POST", "/v1/pages/sizes"),
    ("POST", "/v1/prefixes"),
    ("GET", "/v1/prefixes"),
    ("POST", "/v1/prefetch_candidates"),
    ("GET", "/v1/residency"),
    ("POST", "/v1/engines/resident"),
    ("POST", "/v1/engines/evicted"),
    ("POST", "/v1/engines/forget"),
    ("GET", "/v1/sessions/count"),
    ("POST", "/v1/compact"),
    ("POST", "/v1/mover"),
]


def test_the_fuzzed_operations_are_all_the_operations(api_schema: Any) -> None:
    documented = {(op.ok().method.upper(), op.ok().path) for op in api_schema.get_all_operations()}
    assert documented == set(OPERATIONS)


@pytest.mark.parametrize(("method", "path"), OPERATIONS)
def test_api_answers_every_generated_request_as_documented(
    api_schema: Any, fuzz_target: tuple[Any, str, dss.Store], method: str, path: str
) -> None:
    _, key, _ = fuzz_target
    operation = api_schema[path][method]

    @given(case=operation.as_strategy())
    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def answers_as_documented(case: Any) -> None:
        case.call_and_validate(headers={"Authorization": f"Bearer {key}"}, checks=CHECKS)

    answers_as_documented()


def test_the_store_is_sound_after_fuzzing(fuzz_target: tuple[Any, str, dss.Store]) -> None:
    _, _, store = fuzz_target
    assert store.check() == []
    assert store.tokens("s", 1, tenant_id="fuzz") == [1, 2, 3, 4, 5]
