"""GET /metrics (dss.service.metrics): who may scrape, and exact counts after known requests."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

import dss
from dss.service.apikeys import KeyRing
from dss.service.problems import problem
from dss.service.server import create_app
from tests.service.test_server import LAYOUT, Service, T, page


def scrape(svc: Service, who: str | None = "admin") -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = svc.call("GET", "/metrics", who)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain; version=")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Service]:
    svc = Service(tmp_path / "home")
    with svc.http:
        yield svc


def test_metrics_need_an_admin_key_unless_public(service: Service, tmp_path: Path) -> None:
    assert service.call("GET", "/metrics", None).json() == problem(
        "Unauthorized", 401, "this endpoint needs an API key: send 'Authorization: Bearer <key>'"
    )
    assert service.call("GET", "/metrics", "t1").json() == problem("Forbidden", 403, "/metrics needs an admin API key")
    public = Service(tmp_path / "public", public_metrics=True)
    with public.http:
        assert ("dss_sessions", ()) in scrape(public, None)


def test_request_counts_and_latencies_per_route_and_status(service: Service) -> None:
    service.create()
    service.call("POST", "/v1/resume", json={"session_id": "nope", "tokens": [1]})
    service.call("GET", "/v1/does-not-exist")
    service.call("GET", "/v1/sessions", None)
    m = scrape(service)
    assert m[("dss_http_requests_total", (("method", "POST"), ("route", "/v1/sessions"), ("status", "200")))] == 1
    assert m[("dss_http_requests_total", (("method", "POST"), ("route", "/v1/resume"), ("status", "404")))] == 1
    assert m[("dss_http_requests_total", (("method", "GET"), ("route", "unmatched"), ("status", "404")))] == 1
    assert m[("dss_http_requests_total", (("method", "GET"), ("route", "/v1/sessions"), ("status", "401")))] == 1
    assert m[("dss_http_request_seconds_count", (("method", "POST"), ("route", "/v1/resume")))] == 1
    assert m[("dss_http_requests_in_flight", ())] == 1  # the scrape itself


def test_resume_hits_and_misses_per_tier(service: Service, tmp_path: Path) -> None:
    """Prompt T + 6 tokens = 4 full pages; pages 0 and 1 are stored (host and disk), 2 and 3 not.

    In this process: host holds 0 and 1 -> host hits 2, host misses 2, disk misses 2.
    A second process on the same folder has an empty host tier: disk hits 2, host misses 4,
    disk misses 2.
    """
    service.create()
    service.commit(T, pages={0: page(1), 1: page(2)})
    prompt = T + [1, 2, 3, 4, 5, 6]
    service.ok("POST", "/v1/resume", json={"session_id": "s", "tokens": prompt})
    service.ok("POST", "/v1/resume", json={"session_id": "s", "tokens": [7, 7, 7]})
    m = scrape(service)
    assert m[("dss_resume_total", (("result", "hit"),))] == 1
    assert m[("dss_resume_total", (("result", "miss"),))] == 1
    assert m[("dss_resume_prompt_tokens_total", ())] == 19
    assert m[("dss_resume_matched_tokens_total", ())] == 8
    assert m[("dss_page_hits_total", (("tier", "host"),))] == 2
    assert m[("dss_page_hits_total", (("tier", "disk"),))] == 0
    assert m[("dss_page_misses_total", (("tier", "host"),))] == 2
    assert m[("dss_page_misses_total", (("tier", "disk"),))] == 2
    assert m[("dss_resume_seconds_count", ())] == 2
    assert m[("dss_commits_total", ())] == 1
    assert m[("dss_committed_tokens_total", ())] == 10

    second = dss.open(service.home, fsync=False)
    app = create_app(second, service.config, KeyRing(service.config.keys_file), close_store=True)
    with TestClient(app) as http:
        auth = {"Authorization": f"Bearer {service.keys['admin']}"}
        r = http.post("/v1/resume", json={"session_id": "s", "tokens": prompt}, headers=auth).json()
        assert r["tiers"] == {"disk": 8}
        text = http.get("/metrics", headers=auth).text
    m2 = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert m2[("dss_page_hits_total", (("tier", "disk"),))] == 2
    assert m2[("dss_page_misses_total", (("tier", "host"),))] == 4
    assert m2[("dss_page_misses_total", (("tier", "disk"),))] == 2


def test_store_gauges_sessions_pages_and_bytes_per_tier(service: Service) -> None:
    service.create("a")
    service.create("b", who="t2")
    service.commit(T, "a", pages={0: page(1), 1: page(2)})
    m = scrape(service)
    assert m[("dss_sessions", ())] == 2
    assert m[("dss_tier_pages", (("tier", "host"),))] == 2
    assert m[("dss_tier_pages", (("tier", "disk"),))] == 2
    assert m[("dss_tier_bytes", (("tier", "host"),))] == 2 * LAYOUT.page_bytes
    assert m[("dss_tier_bytes", (("tier", "disk"),))] == service.store.stats()["disk"]["bytes"]
    assert m[("dss_tier_capacity_bytes", (("tier", "host"),))] == 1 << 30
    assert m[("dss_tier_inactive_bytes", (("tier", "host"),))] == 0  # nothing demoted yet


def test_no_label_names_a_tenant_user_or_session(service: Service) -> None:
    service.create("secret-session", user_id="secret-user")
    service.commit(T, "secret-session", pages={0: page(1)})
    service.ok("POST", "/v1/resume", json={"session_id": "secret-session", "tokens": T})
    text = service.call("GET", "/metrics", "admin").text
    assert "secret" not in text and "t1" not in text


def test_erasures_done_open_and_the_age_of_the_oldest(service: Service) -> None:
    from tests.erasure.test_erase import first_step

    service.create("a", user_id="alice")
    service.create("b", user_id="bob")
    service.ok("POST", "/v1/forget_user", "admin", json={"user_id": "alice", "tenant_id": "t1", "dry_run": True})
    m = scrape(service)
    assert m[("dss_erasures_total", (("result", "done"),))] == 0  # a dry run is not an erasure
    service.ok("POST", "/v1/forget_user", "admin", json={"user_id": "alice", "tenant_id": "t1"})
    m = scrape(service)
    assert m[("dss_erasures_total", (("result", "done"),))] == 1
    assert m[("dss_erasures_total", (("result", "failed"),))] == 0
    assert m[("dss_erasures_open", ())] == 0
    assert m[("dss_erasure_oldest_open_seconds", ())] == 0
    job = first_step(service.store, "bob", "t1")  # a job a crash interrupted after its first step
    m = scrape(service)
    assert m[("dss_erasures_open", ())] == 1
    assert 0 < m[("dss_erasure_oldest_open_seconds", ())] < 60
    service.store.eraser.run(job)
    assert scrape(service)[("dss_erasures_open", ())] == 0


def test_remote_tier_gauges_and_errors(tmp_path: Path) -> None:
    """A remote tier nobody answers at: one failed read, two pages waiting to be written."""
    from tests.servers import free_port

    svc = Service(
        tmp_path / "home", store_options={"remote_url": f"redis://127.0.0.1:{free_port()}/0", "remote_timeout_s": 0.2}
    )
    with svc.http:
        m = scrape(svc)
        assert m[("dss_remote_up", ())] == 1
        assert m[("dss_remote_pending_bytes", ())] == 0
        ops = ("get", "put", "delete", "scan", "verify")
        assert {op: m[("dss_remote_errors_total", (("op", op),))] for op in ops} == dict.fromkeys(ops, 0)
        assert svc.store.remote is not None and svc.store.remote.get(["dss:{00}:00"]) == [None]
        svc.create("a")
        svc.commit(T, "a", pages={0: page(1), 1: page(2)})
        m = scrape(svc)
        assert m[("dss_remote_up", ())] == 0
        assert m[("dss_remote_errors_total", (("op", "get"),))] == 1
        assert m[("dss_remote_pending_bytes", ())] == svc.store.remote.pending_bytes > 2 * LAYOUT.page_bytes


def test_placement_counters_watermarks_and_prefetch(service: Service) -> None:
    service.create("a")
    service.commit(T, "a", pages={0: page(1), 1: page(2)})
    store = service.store
    store.host.discard(store.host.ids())  # only disk holds the pages now
    answer = service.call("POST", "/v1/prefetch", "t1", json={"session_id": "a"})
    assert (answer.status_code, answer.json()) == (202, {"session_id": "a", "num_pages": 2})
    deadline = time.monotonic() + 10
    while len(store.host) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)  # the mover thread moves them up
    ids = [r.page_id for r in store.resume("a", T).pages]
    store.read_pages(ids[:1])
    m = scrape(service)
    assert m[("dss_tier_promotions_total", (("tier", "host"),))] == 2
    assert m[("dss_tier_moved_bytes_total", (("tier", "host"),))] == 2 * LAYOUT.page_bytes
    assert m[("dss_tier_demotions_total", (("tier", "host"),))] == 0
    assert m[("dss_tier_evictions_total", (("tier", "disk"),))] == 0
    assert m[("dss_prefetch_hits_total", ())] == 1
    assert m[("dss_prefetch_wasted_total", ())] == 0
    assert m[("dss_tier_high_watermark_bytes", (("tier", "host"),))] == round(0.85 * (1 << 30))
    assert m[("dss_tier_low_watermark_bytes", (("tier", "disk"),))] == round(0.70 * (16 << 30))


def test_resumed_tokens_a_lower_precision_copy_would_serve_are_counted_by_encoding(service: Service) -> None:
    """A handle whose disk keeps int8 saves two pages of a KV layout (tenant t1, as the API key);
    a fresh process (empty host tier) answers the resume over HTTP: 8 int8 tokens, announced."""
    import ml_dtypes
    import numpy as np

    layout = dss.Layout(
        "transformers", 4, 1024, dtype="bfloat16", num_layers=2, num_kv_heads=1, head_dim=32,
        format="[layers][k,v]x[kv_heads,page_tokens,head_dim]",
    )  # fmt: skip
    kv = {i: np.random.default_rng(i).standard_normal(512).astype(ml_dtypes.bfloat16).tobytes() for i in (0, 1)}
    with dss.open(service.home, fsync=False, disk_precision="int8") as writer:
        writer.create_session("q", tenant_id="t1", user_id="u", layout=layout)
        writer.commit("q", T, kv, tenant_id="t1")
    reader = dss.open(service.home, fsync=False)
    app = create_app(reader, service.config, KeyRing(service.config.keys_file), close_store=True)
    with TestClient(app) as http:
        auth = {"Authorization": f"Bearer {service.keys['admin']}"}
        r = http.post("/v1/resume", json={"session_id": "q", "tokens": T}, headers=auth).json()
        assert (r["matched_tokens"], r["encodings"], r["lossy_tokens"]) == (8, {"int8": 8}, 8)
        text = http.get("/metrics", headers=auth).text
    m = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    assert m[("dss_resume_lossy_tokens_total", (("encoding", "int8"),))] == 8
    assert m[("dss_resume_lossy_tokens_total", (("encoding", "k8v4"),))] == 0
