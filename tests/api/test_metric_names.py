"""``/metrics`` follows Prometheus' naming rules: the ones ``promtool check metrics``
applies (client_golang's promlint), checked here in Python since ``make test`` cannot
install promtool. Run ``curl -s localhost:8321/metrics | promtool check metrics`` too.
"""

from __future__ import annotations

import re
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pinfeed import Client, Loader
from tests.api.conftest import synthetic
from tests.conftest import Server
from tests.helpers import unique

BASE_UNITS = {"amperes", "bytes", "celsius", "grams", "joules", "kelvin", "meters", "metres"}
BASE_UNITS |= {"seconds", "volts"}
NON_BASE_UNITS = {"minutes", "hours", "days", "weeks", "kelvins", "fahrenheit", "rankine"}
NON_BASE_UNITS |= {"inches", "yards", "miles", "bits", "calories", "pounds", "ounces"}
PREFIXES = ("pico", "nano", "micro", "milli", "centi", "deci", "deca", "hecto", "kilo", "kibi")
PREFIXES += ("mega", "mibi", "giga", "gibi", "tera", "tebi", "peta", "pebi")
ABBREVIATIONS = ("s", "ms", "us", "ns", "sec", "b", "kb", "mb", "gb", "tb", "pb", "m", "h", "d")
TYPES = ("counter", "gauge", "summary", "histogram", "gauge_histogram")


def _part_or_suffix(name: str, word: str) -> bool:
    return f"_{word}_" in name or name.endswith(f"_{word}")


def lint(text: str) -> list[str]:
    """promlint's problems with an exposition, as ``name: problem`` lines."""
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    helps = dict(re.findall(r"^# HELP (\S+) ?(.*)$", text, re.M))
    labels: dict[str, set[str]] = {name: set() for name in types}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            owner = s.name if s.name in types else re.sub(r"_(bucket|sum|count)$", "", s.name)
            labels.setdefault(owner, set()).update(s.labels)
    problems = []
    for name, kind in types.items():
        lower = name.lower()

        def add(problem: str, name: str = name) -> None:
            problems.append(f"{name}: {problem}")

        if not helps.get(name, "").strip():
            add("no help text")
        if kind == "counter" and not name.endswith("_total"):
            add('counter metrics should have "_total" suffix')
        if kind not in ("counter", "untyped") and name.endswith("_total"):
            add('non-counter metrics should not have "_total" suffix')
        if kind != "untyped":
            if kind != "histogram" and (name.endswith("_bucket") or "le" in labels[name]):
                add("non-histogram metrics should not have a '_bucket' suffix or 'le' label")
            if kind not in ("histogram", "summary") and re.search(r"_(count|sum)$", name):
                add("non-histogram and non-summary metrics should not end in _count or _sum")
            if kind != "summary" and "quantile" in labels[name]:
                add('non-summary metrics should not have "quantile" label')
        for part in name.split("_"):
            unit = next((part[len(p) :] for p in PREFIXES if part.startswith(p)), part)
            if part in NON_BASE_UNITS or (unit != part and unit in BASE_UNITS | NON_BASE_UNITS):
                add(f"use a base unit instead of {part!r}")
        for t in TYPES:
            if _part_or_suffix(lower, t):
                add(f"metric name should not include type '{t}'")
        if ":" in name:
            add("metric names should not contain ':'")
        if re.search(r"[a-z][A-Z]", name) or any(re.search(r"[a-z][A-Z]", n) for n in labels[name]):
            add("names should be written in 'snake_case' not 'camelCase'")
        for abbreviation in ABBREVIATIONS:
            if _part_or_suffix(lower, abbreviation):
                add("metric names should not contain abbreviated units")
        if kind != "gauge" and name.endswith("_timestamp_seconds"):
            add('non-gauge metrics should not have "_timestamp_seconds" suffix')
    return problems


def test_lint_finds_what_promtool_finds() -> None:
    bad = (
        "# HELP a_share_total x\n# TYPE a_share_total gauge\na_share_total 1\n"
        "# HELP b_things x\n# TYPE b_things counter\nb_things 1\n"
        "# TYPE c_wait_ms gauge\nc_wait_ms 1\n"
        "# HELP d_size_kilobytes x\n# TYPE d_size_kilobytes gauge\nd_size_kilobytes 1\n"
        '# HELP e_gauge x\n# TYPE e_gauge gauge\ne_gauge{le="1",fooBar="x"} 1\n'
    )
    problems = "\n".join(lint(bad))
    for expected in (
        'a_share_total: non-counter metrics should not have "_total" suffix',
        'b_things: counter metrics should have "_total" suffix',
        "c_wait_ms: no help text",
        "c_wait_ms: metric names should not contain abbreviated units",
        "d_size_kilobytes: use a base unit instead of 'kilobytes'",
        "e_gauge: metric name should not include type 'gauge'",
        "e_gauge: non-histogram metrics should not have a '_bucket' suffix or 'le' label",
        "e_gauge: names should be written in 'snake_case' not 'camelCase'",
    ):
        assert expected in problems, expected


def test_metrics_pass_promtools_rules(admin: Client, server: Server) -> None:
    name = unique("lint")
    admin.create_dataset(name, "synthetic", synthetic(16))
    admin.create_loader(name, dataset=name, batch_size=4, num_workers=1)
    with Loader(name, socket=server.socket, timeout=60) as loader:
        for _ in loader:
            pass
        deadline = time.monotonic() + 10  # a body is up to PINFEED_METRICS_MAX_AGE_S old
        while f'loader="{name}"' not in (text := httpx.get(f"{server.url}/metrics").text):
            assert time.monotonic() < deadline
            time.sleep(0.1)
    admin.delete_loader(name)
    assert f'pinfeed_loader_next_wait_seconds_bucket{{loader="{name}",le="+Inf"}}' in text
    assert lint(text) == []
