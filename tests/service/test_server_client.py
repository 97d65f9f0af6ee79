"""The client (dss.service.client, dss.service.problems) against a real ``dss serve``: what differs from the
embedded store — keys, tenants, admin rights, transport failures — and error mapping."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import dss
from dss.service.client import Client
from dss.service.problems import (
    Forbidden,
    InternalError,
    PayloadTooLarge,
    Unauthorized,
    Unavailable,
    error_from_problem,
)
from dss.service.process import ServiceProcess, free_port

LAYOUT = dss.Layout(name="client", page_tokens=4, page_bytes=32)
T = list(range(300, 310))


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    with ServiceProcess(tmp_path_factory.mktemp("service"), args=("--max-tokens", "64")) as svc:
        yield svc


def test_connect_uses_the_key_or_dss_api_key(service: ServiceProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    key = service.add_key("env-tenant")
    with pytest.raises(Unauthorized, match="this endpoint needs an API key"):
        dss.connect(service.url).sessions()
    monkeypatch.setenv("DSS_API_KEY", key)
    with dss.connect(service.url) as client:
        assert isinstance(client, Client)
        assert client.info()["tenant_id"] == "env-tenant"
        assert client.health() == {"status": "ok", "version": dss.__version__}
    with pytest.raises(Unauthorized, match="unknown API key"):
        dss.connect(service.url, api_key="dss_000000000000_x").sessions()


def test_identical_sessions_in_two_tenants_never_see_each_other(service: ServiceProcess) -> None:
    a = dss.connect(service.url, api_key=service.add_key("iso-a"))
    b = dss.connect(service.url, api_key=service.add_key("iso-b"))
    for client in (a, b):
        client.create_session("chat", user_id="u", layout=LAYOUT)
        client.commit("chat", T, {0: bytes(32), 1: bytes([1]) * 32})
    a.create_session("a-only", user_id="u", layout=LAYOUT)
    a_head = a.session("chat").head_id
    assert a_head is not None
    assert [s.session_id for s in b.sessions()] == ["chat"]
    assert b.session("chat").tenant_id == "iso-b"
    assert b.session("chat").head_id != a_head
    with pytest.raises(dss.UnknownSession, match="no session 'a-only' in tenant 'iso-b'"):
        b.versions("a-only")
    with pytest.raises(dss.UnknownVersion, match=f"version {a_head} is not a version of session 'chat'"):
        b.tokens("chat", a_head)
    with pytest.raises(dss.UnknownVersion):
        b.rollback("chat", a_head)
    pages_a = a.resume("chat", T).pages
    pages_b = b.resume("chat", T).pages
    assert {p.page_id for p in pages_a}.isdisjoint({p.page_id for p in pages_b})
    assert b.read_pages(pages_a) == [None, None]
    assert b.read_pages(pages_b) == [bytes(32), bytes([1]) * 32]
    assert b.lookup(T, layout=LAYOUT, user_id="u").matched_tokens == 8  # its own chat's pages
    assert [p.page_id for p in b.lookup(T, layout=LAYOUT, user_id="u").pages] == [p.page_id for p in pages_b]
    with pytest.raises(Forbidden, match="this API key may read only its own tenant 'iso-b'"):
        b.session("chat", tenant_id="iso-a")
    with pytest.raises(Forbidden, match="writes go to the API key's own tenant 'iso-b', not 'iso-a'"):
        b.commit("chat", T, tenant_id="iso-a")
    assert a.tokens("chat") == T and len(a.versions("chat")) == 1


def test_admin_only_calls_need_an_admin_key(service: ServiceProcess) -> None:
    plain = dss.connect(service.url, api_key=service.add_key("plain"))
    admin = dss.connect(service.url, api_key=service.add_key("plain", is_admin=True))
    for call in (
        lambda c: c.sql("SELECT 1"),
        lambda c: c.check(),
        lambda c: c.stats(),
        lambda c: c.sessions(all_tenants=True),
    ):
        with pytest.raises(Forbidden, match="needs an admin API key"):
            call(plain)
        call(admin)
    plain.create_session("mine", layout=LAYOUT)
    other = dss.connect(service.url, api_key=service.add_key("other"))
    other.create_session("theirs", layout=LAYOUT)
    assert admin.session("theirs", tenant_id="other").tenant_id == "other"
    assert {"mine", "theirs"} <= {s.session_id for s in admin.sessions(all_tenants=True)}


def test_limits_come_back_as_typed_errors(service: ServiceProcess) -> None:
    client = dss.connect(service.url, api_key=service.add_key("limits"))
    client.create_session("s", layout=LAYOUT)
    assert client.info()["limits"]["max_tokens"] == 64
    with pytest.raises(dss.InvalidTokens, match=r"a request may carry at most 64 tokens \(max_tokens\), got 65"):
        client.commit("s", [1] * 65)
    huge = dss.Layout(name="huge", page_tokens=1, page_bytes=1 << 24)
    client.create_session("h", layout=huge)
    with pytest.raises(PayloadTooLarge, match="request bodies are limited to 33554432 bytes"):
        client.commit("h", [1, 2], {0: bytes(1 << 24), 1: bytes(1 << 24)})
    assert client.versions("h") == []


def test_the_client_is_thread_safe(service: ServiceProcess) -> None:
    client = dss.connect(service.url, api_key=service.add_key("threads"))
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            client.create_session(f"s{i}", layout=LAYOUT)
            for n in range(1, 6):
                client.commit(f"s{i}", T[:n] + [i])
            assert client.tokens(f"s{i}") == T[:5] + [i]
        except (dss.DssError, AssertionError) as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(client.sessions()) == 8


def test_nothing_listening_is_unavailable() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(Unavailable, match=f"cannot reach the dss service at {url}"):
        dss.connect(url, api_key="k", retries=0).sessions()


def test_a_silent_service_times_out_as_unavailable(tmp_path: Path) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        with pytest.raises(
            Unavailable,
            match=r"did not answer POST /v1/commit within 0.3s \(a write may or may "
            r"not have happened\)",
        ):
            dss.connect(url, api_key="k", timeout=0.3).commit("s", [1])


@pytest.mark.parametrize(
    ("status", "body", "cls", "message"),
    [
        (404, {"kind": "UnknownVersion", "detail": "gone"}, dss.UnknownVersion, "gone"),
        (403, {"kind": "ReadOnlyViolation", "detail": "no"}, dss.ReadOnlyViolation, "no"),
        (409, {"kind": "SomethingNew", "detail": "later dss"}, dss.Conflict, "later dss"),
        (502, "<html>bad gateway</html>", InternalError, "HTTP 502: <html>bad gateway</html>"),
        (503, None, Unavailable, "HTTP 503"),
        (418, {"kind": "Exception", "detail": "x"}, dss.InvalidInput, "x"),
    ],
)
def test_problems_map_back_to_dss_errors(status: int, body: object, cls: type[dss.DssError], message: str) -> None:
    exc = error_from_problem(status, body)
    assert type(exc) is cls
    assert str(exc) == message
