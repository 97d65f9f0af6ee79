"""deploy/: the Grafana dashboard and the Prometheus alert rules name only metrics and labels that
``dss serve``'s /metrics exports, their PromQL parses (``promtool check rules``), and the
dashboard is well formed (unique panel ids, panels that do not overlap, one templated data source).
The dashboard shows every metric of the vLLM connector (``vllm:dss_*``, what ``vllm serve``'s
/metrics exports with the connector) and names no other.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.service.test_server import Service

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "dss.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"

PROMQL_WORDS = {
    "sum",
    "min",
    "max",
    "by",
    "on",
    "and",
    "or",
    "unless",
    "rate",
    "increase",
    "offset",
    "scalar",
    "histogram_quantile",
    "ignoring",
    "group_left",
    "label_values",
    "le",
    "job",
    "instance",
}
"""Names in the expressions that are PromQL or target labels, not metrics."""


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def dashboard_exprs() -> list[str]:
    return [t["expr"] for p in dashboard()["panels"] for t in p.get("targets", [])]


def alert_exprs() -> list[str]:
    rules = yaml.safe_load(ALERTS.read_text())
    return [r["expr"] for g in rules["groups"] for r in g["rules"]]


def metric_names(expr: str) -> set[str]:
    """The dss service metric (sample) names an expression reads (not the connector's ``vllm:dss_*``)."""
    return set(re.findall(r"(?<![\w:])(dss_[a-z_]+)\b", expr))


def connector_metric_names(expr: str) -> set[str]:
    """The vLLM connector metric families an expression reads (a histogram's, without its sample suffix)."""
    return {
        re.sub(r"_seconds_(bucket|sum|count)$", "_seconds", name)
        for name in re.findall(r"\b(vllm:dss_[a-z_]+)\b", expr)
    }


def legend_labels() -> set[str]:
    return {
        label
        for p in dashboard()["panels"]
        for t in p.get("targets", [])
        for label in re.findall(r"\{\{\s*(\w+)\s*\}\}", t.get("legendFormat", ""))
    }


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[dict[str, set[str]]]:
    """``sample name -> label names`` of everything a service's /metrics exports after some work
    (with a remote tier: its metrics exist only then)."""
    svc = Service(
        tmp_path_factory.mktemp("deploy") / "home",
        store_options={"remote_url": redis_url, "remote_prefix": "dss-deploy-test:"},
    )
    with svc.http:
        svc.create("a")
        svc.commit([1] * 16, "a")
        svc.ok("POST", "/v1/resume", json={"session_id": "a", "tokens": [1] * 16})
        svc.ok("POST", "/v1/forget_user", "admin", json={"user_id": "nobody", "tenant_id": "t1"})
        text = svc.call("GET", "/metrics", "admin").text
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        names = {s.name for s in family.samples} or {family.name}
        if family.type == "counter":
            names.add(family.name + "_total")
        if family.type == "histogram":
            names |= {family.name + suffix for suffix in ("_bucket", "_sum", "_count")}
        for name in names:
            out.setdefault(name, set()).update(k for s in family.samples for k in s.labels)
    # label names of families with no samples yet come from the exposition's own declarations
    for name, labels in _declared_labels(text).items():
        out.setdefault(name, set()).update(labels)
    yield out


def _declared_labels(text: str) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for line in text.splitlines():
        m = re.match(r"^([a-z_:]+)\{([^}]*)\}", line)
        if m:
            found.setdefault(m.group(1), set()).update(re.findall(r"(\w+)=", m.group(2)))
    return found


@pytest.mark.parametrize("source", ["dashboard", "alerts"])
def test_every_metric_referenced_is_exported(source: str, exported: dict[str, set[str]]) -> None:
    exprs = dashboard_exprs() if source == "dashboard" else alert_exprs()
    referenced = set().union(*(metric_names(e) for e in exprs))
    assert referenced, "the expressions name no dss metric"
    assert sorted(referenced - exported.keys()) == []


def test_every_label_grouped_by_or_shown_is_exported(exported: dict[str, set[str]]) -> None:
    """``by (tier)`` and ``{{tier}}`` name labels the metrics carry (or Prometheus adds)."""
    known = set().union(*exported.values()) | {"job", "instance", "le"}
    grouped = {
        label.strip()
        for e in dashboard_exprs() + alert_exprs()
        for group in re.findall(r"by \(([^)]*)\)", e)
        for label in group.split(",")
    }
    assert sorted((grouped | legend_labels()) - known) == []


def test_the_dashboard_is_well_formed() -> None:
    dash = dashboard()
    panels = dash["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"panel {p['title']!r} overlaps another"
        cells |= mine
        for t in p.get("targets", []):
            assert t["datasource"]["uid"] == "${datasource}"
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert variables == {"datasource", "job", "engine_job"}
    titles = {p["title"] for p in panels}
    for wanted in (
        "Hit share per tier (pages)",
        "Resume latency",
        "Commits",
        "Tier fill against its watermarks",
        "Erasures",
        "Connector requests by result",
        "Connector loaded tokens by tier",
        "Connector late misses and failed pages",
    ):
        assert wanted in titles


def test_the_dashboard_shows_every_connector_metric_and_no_other() -> None:
    """Every family :class:`dss_adapters.vllm.metrics.DssPromMetrics` exports has a panel (the
    list is checked against the families it registers in tests/adapters/vllm/test_vllm_metrics.py), each read
    from the vLLM job (``$engine_job``), with its labels."""
    from dss_adapters.vllm.metrics import METRICS

    exprs = [e for e in dashboard_exprs() if "vllm:dss_" in e]
    shown = set().union(*(connector_metric_names(e) for e in exprs))
    assert sorted(shown) == sorted(METRICS)
    assert all('{job=~"$engine_job"}' in e and "$job" not in e.replace("$engine_job", "") for e in exprs)
    assert any("sum by (result) (rate(vllm:dss_requests_total" in e for e in exprs)
    assert any("sum by (tier) (rate(vllm:dss_loaded_tokens_total" in e for e in exprs)
    assert any("sum by (tier) (rate(vllm:dss_late_miss_pages_total" in e for e in exprs)


@pytest.fixture(scope="module")
def promtool(tmp_path_factory: pytest.TempPathFactory) -> str:
    """promtool from PATH, else unpacked from Debian's ``prometheus`` package (no root needed)."""
    found = shutil.which("promtool")
    if found:
        return found
    where = tmp_path_factory.mktemp("promtool")
    if shutil.which("apt-get") and shutil.which("dpkg"):
        got = subprocess.run(["apt-get", "download", "prometheus"], cwd=where, capture_output=True, timeout=300)
        debs = list(where.glob("prometheus_*.deb"))
        if got.returncode == 0 and debs:
            subprocess.run(["dpkg", "-x", str(debs[0]), str(where / "root")], check=True, timeout=120)
            tool = where / "root" / "usr" / "bin" / "promtool"
            if tool.exists():
                return str(tool)
    pytest.skip("promtool cannot be installed here (no promtool on PATH, no Debian package)")


def test_promtool_accepts_the_alert_rules(promtool: str) -> None:
    out = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(alert_exprs())} rules found" in out.stdout


def test_promtool_parses_every_dashboard_query(promtool: str, tmp_path: Path) -> None:
    """Each panel query, with Grafana's variables filled in, as a recording rule promtool checks."""
    rules = [
        {
            "record": f"dss:panel_{i}",
            "expr": e.replace("$__rate_interval", "5m").replace("$engine_job", ".*").replace("$job", ".*"),
        }
        for i, e in enumerate(dashboard_exprs())
    ]
    path = tmp_path / "panels.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    out = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
