"""docs/grafana/vllm-kvevict.json is an importable Grafana dashboard whose queries name only series
that exist: ours are defined in server/metrics.py, vLLM's are
registered by its PrometheusStatLogger. Server tests call `missing_from_exposition` on a live
/metrics page."""

from __future__ import annotations

import importlib.util
import json
import re
from functools import lru_cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "docs" / "grafana" / "vllm-kvevict.json"
DS_UID = "${DS_PROMETHEUS}"  # the import-time datasource input, replaced by Grafana on import

# --- metric names in PromQL ---------------------------------------------------------------------

_SUFFIXES = ("_bucket", "_sum", "_count", "_total", "_created")
# Sample names a family exposes, by type (_created left out: multiprocess mode has none).
_EXPOSED = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
            "summary": ("", "_sum", "_count"), "info": ("_info",)}  # others: the name itself
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
# label lists of aggregations and vector matching: `by (le, policy)`, `on (x)`, `group_left (y)`
_LABEL_LISTS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_BRACKETS = re.compile(r"\{[^}]*\}|\[[^\]]*\]")  # label matchers; range and subquery durations
# A whole identifier (not the tail of a word, of a number such as 1e3, or of a $variable) that is
# not called: functions and aggregations are always followed by "(".
_IDENT = re.compile(r"(?<![\w:.$])[a-zA-Z_:][\w:]*(?![\w:])(?!\s*\()")
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
             "unless", "offset", "inf", "nan"}
_LABEL_VALUES = re.compile(r"^\s*label_values\s*\((.+),\s*\w+\s*\)\s*$")  # Grafana variable query


def series_in(expr: str) -> set[str]:
    """Metric names an expression selects (as written: with _bucket/_total/...)."""
    expr = _BRACKETS.sub(" ", _LABEL_LISTS.sub(" ", _STRINGS.sub('""', expr)))
    return {name for name in _IDENT.findall(expr) if name.lower() not in _KEYWORDS}


def base_series(name: str) -> str:
    """Family name: strips exposition suffixes, repeatedly (vLLM's histogram
    vllm:iteration_tokens_total exposes vllm:iteration_tokens_total_bucket)."""
    while name.endswith(_SUFFIXES):
        name = name[: name.rindex("_")]
    return name


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(dashboard: dict) -> list[dict]:
    """Every panel, including those inside collapsed rows."""
    out = []
    for panel in dashboard["panels"]:
        out += [panel, *panel.get("panels", [])]
    return out


def exprs(dashboard: dict) -> list[str]:
    """Every PromQL expression: panel targets and the metric of label_values() variables."""
    out = [t["expr"] for p in panels(dashboard) for t in p.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        query = var.get("query")
        query = query.get("query", "") if isinstance(query, dict) else query or ""
        if var["type"] == "query" and (m := _LABEL_VALUES.match(query)):
            out.append(m.group(1))
    return out


def dashboard_series() -> set[str]:
    """Every metric name the dashboard queries, as written in its expressions."""
    return set().union(*map(series_in, exprs(load_dashboard())))


def exposed(name: str, kind: str) -> set[str]:
    """Sample names of a family of type kind. Names are compared exposed, not as base names: a
    gauge vllm_kvevict_pool_blocks and a query of vllm_kvevict_pool_blocks_total have the same
    base name, but the query finds nothing."""
    if kind == "counter":  # prometheus_client drops a trailing _total from the name, then adds it
        name = name.removesuffix("_total")
    return {name + suffix for suffix in _EXPOSED.get(kind, ("",))}


def missing_from_exposition(metrics_text: str) -> set[str]:
    """The dashboard's series (as its queries name them) without a sample on a /metrics page. A
    family declared (# HELP/# TYPE) with no sample yet counts as missing: its panels would be
    empty, so serve a request before scraping."""
    return dashboard_series() - set(re.findall(r"^([a-zA-Z_:][\w:]*)", metrics_text, re.M))


@lru_cache(maxsize=None)
def kvevict_defined() -> frozenset[str]:
    """Exposed names of server/metrics.py's series."""
    from prometheus_client import CollectorRegistry

    from server.metrics import KVEvictMetrics

    registry = CollectorRegistry()
    KVEvictMetrics(registry=registry)
    return frozenset().union(*(exposed(f.name, f.type) for f in registry.collect()))


@lru_cache(maxsize=None)
def vllm_registered() -> frozenset[str]:
    """Exposed names of the series that vLLM's PrometheusStatLogger creates, from its source: the
    "vllm:..." literal passed as name= to self._{gauge,counter,histogram}_cls(...)."""
    # find_spec locates the installed loggers.py without importing it (and torch): ~4 s less
    # than inspect.getsourcefile on the imported module.
    source = Path(importlib.util.find_spec("vllm.v1.metrics.loggers").origin).read_text()
    assert "class PrometheusStatLogger" in source
    found = re.findall(r"""_(gauge|counter|histogram)_cls\(\s*name=["'](vllm:[\w:]+)["']""",
                       source)
    assert len(found) > 20, "vLLM's loggers.py no longer registers series this way"
    return frozenset().union(*(exposed(name, kind) for kind, name in found))


# --- tests ------------------------------------------------------------------------------------


def test_series_in_extracts_only_metric_names():
    assert series_in('histogram_quantile(0.9, sum by (le, policy) (rate(a_bucket{policy=~"$p",'
                     'le!="x"}[$__rate_interval])))') == {"a_bucket"}
    assert series_in("sum(rate(vllm:b_total[5m])) by (model_name) / on (x) group_left c "
                     "> bool 1e3 offset 5m") == {"vllm:b_total", "c"}
    assert series_in("vllm:num_requests_running") == {"vllm:num_requests_running"}
    assert base_series("vllm:iteration_tokens_total_bucket") == "vllm:iteration_tokens"


def test_dashboard_is_valid():
    dash = load_dashboard()
    assert dash["schemaVersion"] >= 36 and dash["title"] and dash["uid"]
    assert {"name": "DS_PROMETHEUS", "type": "datasource", "pluginId": "prometheus"}.items() <= \
        dash["__inputs"][0].items()
    ids = [p["id"] for p in panels(dash)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels(dash):
        assert {"gridPos", "title", "type"} <= panel.keys(), panel.get("id")
        if panel["type"] == "row":
            continue
        assert panel["type"] in {"timeseries", "stat"}, panel["title"]
        assert panel["datasource"]["uid"] == DS_UID, panel["title"]
        assert panel["targets"], panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip() and target["refId"], panel["title"]
            assert target.get("datasource", {"uid": DS_UID})["uid"] == DS_UID, panel["title"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["policy"]["query"]["query"] == \
        "label_values(vllm_kvevict_requests_total, policy)"
    for var in variables.values():
        assert var["datasource"]["uid"] == DS_UID, var["name"]
    # every $variable in a query is a template variable or one of Grafana's own
    used = {v for e in exprs(dash) for v in re.findall(r"\$\{?(\w+)", e)}
    assert used <= variables.keys() | {"__rate_interval", "__range", "__interval"}


def test_promql_shapes():
    for expr in exprs(load_dashboard()):
        # rate/increase only of counters and histogram parts, never of gauges
        for name in re.findall(r"\b(?:rate|irate|increase)\(\s*([a-zA-Z_:][\w:]*)", expr):
            assert name.endswith(("_total", "_bucket", "_sum", "_count")), expr
        if "histogram_quantile" in expr:
            assert "_bucket{" in expr and re.search(r"\bby \((?:[^)]*\W)?le\b", expr), expr
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr


def test_dashboard_names_only_our_and_vllm_series():
    assert dashboard_series()
    assert all(n.startswith(("vllm_kvevict_", "vllm:")) for n in dashboard_series()), \
        dashboard_series()


def test_kvevict_series_are_defined_in_server_metrics():
    ours = {n for n in dashboard_series() if n.startswith("vllm_kvevict_")}
    unknown = ours - kvevict_defined()
    assert not unknown, f"not exposed by server/metrics.py: {sorted(unknown)}"


def test_every_kvevict_family_has_a_panel():
    plotted = {base_series(n) for n in dashboard_series()}
    families = {base_series(n) for n in kvevict_defined()}
    assert families <= plotted, sorted(families - plotted)


def test_vllm_series_are_registered_by_prometheus_stat_logger():
    theirs = {n for n in dashboard_series() if n.startswith("vllm:")}
    assert theirs <= vllm_registered(), sorted(theirs - vllm_registered())


def test_missing_from_exposition_reads_exposition_format():
    from prometheus_client import CollectorRegistry, generate_latest

    from server.metrics import KVEvictMetrics

    registry = CollectorRegistry()
    KVEvictMetrics(registry=registry).observe({"policy": "snapkv", "footprint": 0.3,
                                               "measured_footprint": 0.4,
                                               "kv_bytes_saved": 10, "blocks_freed": 2})
    missing = missing_from_exposition(generate_latest(registry).decode())
    # the pool gauges are set per engine step, not by observe(); vLLM's series are not here
    assert missing == {n for n in dashboard_series() if n.startswith("vllm:")} | \
        {n for n in dashboard_series() if n.startswith("vllm_kvevict_pool_")}
    assert missing_from_exposition("") == dashboard_series()
