"""Checks the PromQL of the rules and dashboards against the metric contract.

1. deploy/observability/metrics.txt and docs/deploy.md's contract ("Metrics") name the same
   families with the same labels and label values.
2. Every dashboard query (panel targets and variable queries, Grafana's variables replaced by
   plain values) parses: they go into a temporary rules file, one recording rule each, that
   `promtool check rules` must accept.
3. Every series a rule or a dashboard selects is a family of metrics.txt (histograms through
   _bucket, _sum and _count only) or a series the rules record; rate() and increase() take only
   counters and histogram parts; label matchers name labels the family has, and `=` values (and
   `=~` patterns) match values it can take.
4. Every family of metrics.txt is used by a rule or a dashboard, and every recorded series by a
   dashboard or an alert, directly or through recording rules that one of them reads.

dashboard_queries() and plain_promql() need only the standard library (the Prometheus integration
test, tests/integration/prometheus_rules_test.sh, imports them).

Usage: python check_queries.py --rules FILE --dashboards DIR --metrics FILE --contract FILE
       [--promtool PATH]. Exits 1 and lists the problems when there are any.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import subprocess
import sys
import tempfile
from typing import Iterator, Optional

TARGET_LABELS = {"namespace", "job", "instance", "pod", "container", "endpoint", "service"}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
# Grafana's variables, replaced so that a query is plain PromQL.
GRAFANA_VARIABLES = {
    "$__rate_interval": "5m",
    "$__interval": "1m",
    "$__range": "1h",
}

# A selected series: a name of ours, `up`, or an external exporter's (DCGM_), then optionally its
# matchers. Not a label value (a preceding quote) nor part of a longer name.
SELECTOR = re.compile(
    r'(?<![\w:"])((?:dsa_|process_|dsa:|DCGM_)[A-Za-z0-9_:]*|up)(?![\w:])(\s*\{[^}]*\})?')
MATCHER = re.compile(r'([A-Za-z_]\w*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
RATE_BEFORE = re.compile(r"\b(rate|irate|increase)\s*\(\s*$")
BY_CLAUSE = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")


class Family:
    """One metric family: its type and, per label, the values it takes (None: any)."""

    def __init__(self, name: str, kind: str, labels: dict[str, Optional[set[str]]]):
        self.name = name
        self.kind = kind
        self.labels = labels


def parse_labels(items: list[str]) -> dict[str, Optional[set[str]]]:
    labels: dict[str, Optional[set[str]]] = {}
    for item in items:
        name, _, values = item.strip().partition("=")
        labels[name] = None if values in ("", "*") else set(values.split("|"))
    return labels


def load_metrics(path: pathlib.Path) -> dict[str, Family]:
    families = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, kind, *labels = line.split()
        families[name] = Family(name, kind, parse_labels(labels))
    return families


def contract_metrics(path: pathlib.Path) -> dict[str, dict[str, Optional[set[str]]]]:
    """The families named in docs/deploy.md's "### Metrics" section (`name{label=a|b,label}`)."""
    text = path.read_text()
    start = text.index("### Metrics")
    end = text.find("\n## ", start)
    section = text[start:end if end >= 0 else len(text)]
    found = {}
    for code in re.findall(r"`([^`]+)`", section):
        m = re.fullmatch(r"((?:dsa_|process_)[a-z0-9_]+)(?:\{([^}]*)\})?", code)
        if m:
            found[m.group(1)] = parse_labels(m.group(2).split(",")) if m.group(2) else {}
    return found


def dashboard_queries(path: pathlib.Path) -> Iterator[tuple[str, str]]:
    """(where, expr) of every panel target and query variable of one dashboard."""
    model = json.loads(path.read_text())

    def panels(items):
        for panel in items:
            yield panel
            yield from panels(panel.get("panels", []))

    for panel in panels(model.get("panels", [])):
        for target in panel.get("targets", []):
            if target.get("expr"):
                yield f"{path.name}: panel '{panel.get('title')}' {target.get('refId')}", \
                    target["expr"]
    for variable in model.get("templating", {}).get("list", []):
        if variable.get("type") != "query":
            continue
        q = variable.get("query")
        q = q.get("query", "") if isinstance(q, dict) else q
        m = re.fullmatch(r"\s*label_values\((.*),\s*\w+\s*\)\s*", q or "")
        m = m or re.fullmatch(r"\s*query_result\((.*)\)\s*", q or "")
        yield f"{path.name}: variable '{variable.get('name')}'", m.group(1) if m else q


def plain_promql(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    return re.sub(r"\$\{?\w+\}?", ".*", expr)


def check_contract(families, contract, problems):
    ours = {n: f for n, f in families.items() if f.kind not in ("scrape", "external")}
    for name in sorted(set(contract) - set(ours)):
        problems.append(f"metrics.txt: {name} is in the contract (docs/deploy.md) but not here")
    for name in sorted(set(ours) - set(contract)):
        problems.append(f"metrics.txt: {name} is not in the contract (docs/deploy.md)")
    for name in sorted(set(contract) & set(ours)):
        if contract[name] != ours[name].labels:
            problems.append(f"metrics.txt: {name}'s labels {ours[name].labels} differ from the "
                            f"contract's {contract[name]}")


def check_expr(where, expr, families, recorded, problems, used):
    for m in SELECTOR.finditer(expr):
        name, matchers = m.group(1), m.group(2) or ""
        before = expr[:m.start()]
        in_rate = RATE_BEFORE.search(before) is not None
        if name.startswith("dsa:"):
            if name not in recorded:
                problems.append(f"{where}: {name} is not recorded by the rules")
                continue
            used.add(name)
            known = {"namespace", "job"} | {
                label.strip() for clause in BY_CLAUSE.findall(recorded[name])
                for label in clause.split(",") if label.strip()}
            for label, _, _ in MATCHER.findall(matchers):
                if label not in known:
                    problems.append(f"{where}: {name} has no label {label}")
            continue
        family, suffix = families.get(name), ""
        if family is None:
            for s in HISTOGRAM_SUFFIXES:
                base = families.get(name[:-len(s)]) if name.endswith(s) else None
                if base is not None and base.kind == "histogram":
                    family, suffix = base, s
        if family is None:
            problems.append(f"{where}: {name} is not in metrics.txt (the contract)")
            continue
        used.add(family.name)
        if family.kind == "histogram" and not suffix:
            problems.append(f"{where}: histogram {name} is read only as _bucket, _sum or _count")
        if in_rate and family.kind not in ("counter", "histogram"):
            problems.append(f"{where}: rate/increase of {family.kind} {name}")
        allowed = dict(family.labels)
        if suffix == "_bucket":
            allowed["le"] = None
        for label, op, value in MATCHER.findall(matchers):
            if label in TARGET_LABELS:
                continue
            if label not in allowed:
                problems.append(f"{where}: {name} has no label {label}")
                continue
            values = allowed[label]
            if values is None or "$" in value:
                continue
            if op in ("=", "!=") and value not in values:
                problems.append(f"{where}: {name}{{{label}}} takes {sorted(values)}, not {value!r}")
            if op in ("=~", "!~") and not any(re.fullmatch(value, v) for v in values):
                problems.append(f"{where}: {name}{{{label}=~{value!r}}} matches none of "
                                f"{sorted(values)}")


def promtool_check(exprs: list[tuple[str, str]], promtool: str, problems: list[str]) -> None:
    import yaml  # pylint: disable=import-outside-toplevel (the rest needs only the standard library)

    rules = {"groups": [{"name": "dashboard-queries", "rules": [
        {"record": f"check:dashboard_query_{i}", "expr": plain_promql(expr)}
        for i, (_, expr) in enumerate(exprs)]}]}
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        yaml.safe_dump(rules, f, sort_keys=False)
        f.flush()
        out = subprocess.run([promtool, "check", "rules", f.name], capture_output=True,
                             text=True, check=False)
    if out.returncode != 0:
        problems.append("promtool check rules of the dashboards' queries failed:\n"
                        + out.stdout + out.stderr)
        for i, (where, expr) in enumerate(exprs):
            if f"check:dashboard_query_{i}" in out.stdout + out.stderr:
                problems.append(f"  query {i}: {where}: {expr}")
    else:
        print(f"check_queries: promtool accepts the dashboards' {len(exprs)} queries")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rules", type=pathlib.Path, required=True)
    parser.add_argument("--dashboards", type=pathlib.Path, required=True)
    parser.add_argument("--metrics", type=pathlib.Path, required=True)
    parser.add_argument("--contract", type=pathlib.Path, required=True)
    parser.add_argument("--promtool", default="promtool")
    args = parser.parse_args()

    import yaml  # pylint: disable=import-outside-toplevel

    problems: list[str] = []
    families = load_metrics(args.metrics)
    check_contract(families, contract_metrics(args.contract), problems)

    groups = yaml.safe_load(args.rules.read_text())["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    recorded = {rule["record"]: rule["expr"] for rule in rules if "record" in rule}
    used_by_rules: set[str] = set()
    for rule in rules:
        where = f"{args.rules.name}: {rule.get('record') or rule.get('alert')}"
        check_expr(where, rule["expr"], families, recorded, problems, used_by_rules)
    used_by_alerts: set[str] = set()
    for rule in rules:
        if "alert" in rule:
            check_expr(rule["alert"], rule["expr"], families, recorded, [], used_by_alerts)

    exprs = [q for path in sorted(args.dashboards.glob("*.json")) for q in dashboard_queries(path)]
    if not exprs:
        problems.append(f"no dashboard queries under {args.dashboards}")
    used_by_dashboards: set[str] = set()
    for where, expr in exprs:
        check_expr(where, plain_promql(expr), families, recorded, problems, used_by_dashboards)
    promtool_check(exprs, args.promtool, problems)

    for name in sorted(set(families) - used_by_rules - used_by_dashboards):
        problems.append(f"metrics.txt: {name} is used by no rule and no dashboard")
    # A recorded series read by a recording rule that is itself used counts as used.
    used = used_by_dashboards | used_by_alerts
    pending = list(used)
    while pending:
        name = pending.pop()
        if name not in recorded:
            continue
        reads: set[str] = set()
        check_expr(name, recorded[name], families, recorded, [], reads)
        pending += sorted(reads - used)
        used |= reads
    for name in sorted(set(recorded) - used):
        problems.append(f"{args.rules.name}: {name} is recorded but used by no dashboard or alert")

    for problem in problems:
        print(f"check_queries: {problem}", file=sys.stderr)
    if problems:
        return 1
    print(f"check_queries: {len(rules)} rules and {len(exprs)} dashboard queries use only the "
          f"{len(families)} families of {args.metrics.name}, which match the contract")
    return 0


if __name__ == "__main__":
    sys.exit(main())
