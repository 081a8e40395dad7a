#!/usr/bin/python3
"""Checks the Grafana dashboards and Prometheus rules beyond what promtool checks.

    monitoring/tools/lint.py [--root DIR] [--doc FILE] [--tests DIR] [FILE...]

FILEs are dashboards (.json) and rule files (.yml); default: every one under
monitoring/grafana/dashboards and monitoring/prometheus/rules.

Dashboards: valid JSON; uid, title, schemaVersion; a `datasource` variable (type datasource,
query prometheus) and multi-value, include-all `job` and `instance` query variables; every
panel and target on the ${datasource} datasource; unique integer panel ids, and unique panel
titles (queries.py names expressions by title); a gridPos inside 24 columns; every target with
a non-empty expr and a refId unique in its panel; a unit on every graph and stat; every metric
selector with a `job` matcher (panels must not mix scrape jobs by accident); only known Grafana
variables.

Rules: every alert has `for`, labels.severity warning or critical, annotations summary and
description; and the promtool unit tests in --tests have, for every alert, an evaluation that
expects it to fire and one that expects it not to.

Both: every metric an expression reads (queries.py) is documented in docs/METRICS.md (a
histogram X documents X_bucket, X_sum, X_count, not X itself), is a DCGM_ metric named there,
or is `up`.

Prints one `FAIL: file: where: what` line per problem; exits 1 if there is any.
"""

import argparse
import glob
import json
import os
import re
import sys

import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import queries  # noqa: E402

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
NEEDS_UNIT = {"timeseries", "stat", "gauge", "bargauge"}
SEVERITIES = {"warning", "critical"}
NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def documented_metrics(doc_path):
    """Metric names in docs/METRICS.md: first cells of its tables, and DCGM_ names anywhere."""
    with open(doc_path) as f:
        text = f.read()
    names = {"up"}
    for line in text.splitlines():
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        m = re.fullmatch(r"`([^`]+)`", cells[0])
        if not m or not NAME.fullmatch(m.group(1)):
            continue  # a header, a separator, or the scrape-job table's `offload-controller`
        name = m.group(1)
        kind = cells[1] if len(cells) > 1 else ""
        if "histogram" in kind:
            names.update(name + suffix for suffix in ("_bucket", "_sum", "_count"))
        else:
            names.add(name)
    names.update(re.findall(r"`(DCGM_[A-Z0-9_]+)`", text))
    return names


class Lint:
    def __init__(self, root):
        self.root = root
        self.failures = []

    def fail(self, path, where, what):
        self.failures.append(f"FAIL: {queries.display_path(path, self.root)}: {where}: {what}")

    # ------------------------------------------------------------------ dashboards

    def dashboard(self, path):
        try:
            with open(path) as f:
                dash = json.load(f)
        except (OSError, ValueError) as e:
            self.fail(path, "file", f"not valid JSON: {e}")
            return False
        for key in ("uid", "title"):
            if not isinstance(dash.get(key), str) or not dash.get(key):
                self.fail(path, "dashboard", f"no {key}")
        if not isinstance(dash.get("schemaVersion"), int):
            self.fail(path, "dashboard", "no integer schemaVersion")

        variables = {v.get("name"): v for v in dash.get("templating", {}).get("list", [])}
        ds = variables.get("datasource")
        if not ds or ds.get("type") != "datasource" or ds.get("query") != "prometheus":
            self.fail(path, "variables", "no `datasource` variable of type datasource, "
                                         "query prometheus")
        for name in ("job", "instance"):
            var = variables.get(name)
            if not var or var.get("type") != "query":
                self.fail(path, "variables", f"no `{name}` query variable")
                continue
            if not (var.get("multi") and var.get("includeAll")):
                self.fail(path, f"variable {name}", "not multi-value with All")
            if var.get("datasource") != DATASOURCE:
                self.fail(path, f"variable {name}", "datasource is not ${datasource}")
            query = var.get("query")
            query = query.get("query") if isinstance(query, dict) else query
            if not queries.label_values_selector(query or ""):
                self.fail(path, f"variable {name}", "query is not label_values(SELECTOR, label)")

        ids, titles = set(), set()
        panels = list(queries.walk_panels(dash.get("panels")))
        if not panels:
            self.fail(path, "dashboard", "no panels")
        for panel in panels:
            title = panel.get("title") or f"panel id {panel.get('id')}"
            where = f"panel {title!r}"
            pid = panel.get("id")
            if not isinstance(pid, int):
                self.fail(path, where, "no integer id")
            elif pid in ids:
                self.fail(path, where, f"duplicate panel id {pid}")
            ids.add(pid)
            if not panel.get("title"):
                self.fail(path, where, "no title")
            elif panel.get("type") != "row":
                # queries.py names an expression by file and panel title: keep that unambiguous
                if panel["title"] in titles:
                    self.fail(path, where, "duplicate panel title")
                titles.add(panel["title"])
            pos = panel.get("gridPos") or {}
            if not all(isinstance(pos.get(k), int) for k in ("h", "w", "x", "y")):
                self.fail(path, where, "no gridPos with integer h, w, x, y")
            elif pos["x"] + pos["w"] > 24:
                self.fail(path, where, "gridPos wider than 24 columns")
            if panel.get("type") == "row":
                if panel.get("targets"):
                    self.fail(path, where, "a row with targets")
                continue
            if panel.get("datasource") != DATASOURCE:
                self.fail(path, where, f"datasource is {panel.get('datasource')!r}, "
                                       "not ${datasource}")
            if panel.get("type") in NEEDS_UNIT:
                unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit")
                if not unit:
                    self.fail(path, where, "no unit (fieldConfig.defaults.unit)")
            targets = panel.get("targets") or []
            if not targets:
                self.fail(path, where, "no targets")
            ref_ids = set()
            for target in targets:
                ref = target.get("refId")
                if not ref:
                    self.fail(path, where, "a target without refId")
                elif ref in ref_ids:
                    self.fail(path, where, f"duplicate refId {ref}")
                ref_ids.add(ref)
                if target.get("datasource") != DATASOURCE:
                    self.fail(path, where, f"target {ref} datasource is "
                                           f"{target.get('datasource')!r}, not ${{datasource}}")
                expr = target.get("expr")
                if not isinstance(expr, str) or not expr.strip():
                    self.fail(path, where, f"target {ref} has no expr")
                    continue
                try:
                    sels = queries.selectors(queries.substitute(expr, variables))
                except queries.QueryError:
                    continue  # reported with the metric names, by metric_names()
                if not sels:
                    self.fail(path, where, f"target {ref} reads no metric")
                for name, matchers in sels:
                    if not matchers or not re.search(r"(^|, )job (=|=~) ", matchers):
                        self.fail(path, where, f"target {ref}: {name} has no job matcher "
                                               '(job=~"$job", or a fixed job)')
        return True

    # ------------------------------------------------------------------ rules

    def rules(self, path):
        """Alert metadata; returns the alert names (None if the file cannot be read)."""
        try:
            with open(path) as f:
                doc = yaml.safe_load(f) or {}
        except (OSError, yaml.YAMLError) as e:
            self.fail(path, "file", f"not valid YAML: {e}")
            return None
        alerts = []
        for group in doc.get("groups") or []:
            for rule in group.get("rules") or []:
                name = rule.get("alert")
                if not name:
                    continue
                alerts.append(name)
                where = f"alert {name}"
                if "for" not in rule:
                    self.fail(path, where, "no `for`")
                severity = (rule.get("labels") or {}).get("severity")
                if severity not in SEVERITIES:
                    self.fail(path, where, f"labels.severity is {severity!r}, not one of "
                                           f"{sorted(SEVERITIES)}")
                annotations = rule.get("annotations") or {}
                for key in ("summary", "description"):
                    if not str(annotations.get(key, "")).strip():
                        self.fail(path, where, f"no annotations.{key}")
        return alerts

    def rule_tests(self, tests_dir, alerts):
        """Every alert in ALERTS ({name: rule file}) must fire in one evaluation and be
        expected quiet in another."""
        fired, quiet = set(), set()
        for path in sorted(glob.glob(os.path.join(tests_dir, "*.test.yml"))):
            try:
                with open(path) as f:
                    doc = yaml.safe_load(f) or {}
            except (OSError, yaml.YAMLError) as e:
                self.fail(path, "file", f"not valid YAML: {e}")
                continue
            for test in doc.get("tests") or []:
                for case in test.get("alert_rule_test") or []:
                    (fired if case.get("exp_alerts") else quiet).add(case.get("alertname"))
        for name, path in sorted(alerts.items()):
            if name not in fired:
                self.fail(path, f"alert {name}", f"no unit test in {tests_dir} where it fires")
            if name not in quiet:
                self.fail(path, f"alert {name}",
                          f"no unit test in {tests_dir} where it does not fire")

    # ------------------------------------------------------------------ metric names

    def metric_names(self, files, known, doc_path):
        doc = os.path.relpath(doc_path, self.root)

        for path in files:
            prefix = queries.display_path(path, self.root) + ":"

            def where(source):
                name = source[len(prefix):]
                if not path.endswith(".json"):
                    return f"rule {name}"
                return name if name.startswith("variable ") else f"panel {name!r}"

            errors = []
            try:
                items = list(queries.entries([path], self.root, errors))
            except (OSError, ValueError, yaml.YAMLError) as e:
                self.fail(path, "file", str(e))
                continue
            for source, message in errors:
                self.fail(path, where(source), f"cannot read the expression: {message}")
            for item in items:
                for name in item["selectors"]:
                    if name not in known:
                        self.fail(path, where(item["source"]), f"metric {name} is not in {doc}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="*", help="dashboards (.json) and rule files (.yml)")
    parser.add_argument("--root", default=queries.DEFAULT_ROOT, help="repository root")
    parser.add_argument("--doc", help="the metrics contract (default: ROOT/docs/METRICS.md)")
    parser.add_argument("--tests", help="promtool unit tests folder "
                                        "(default: ROOT/monitoring/prometheus/tests)")
    args = parser.parse_args()
    root = os.path.abspath(args.root)
    doc = args.doc or os.path.join(root, "docs", "METRICS.md")
    tests = args.tests or os.path.join(root, "monitoring", "prometheus", "tests")
    files = args.files or queries.default_files(root)

    lint = Lint(root)
    known = documented_metrics(doc)
    alerts = {}
    readable = []
    dashboards = rule_files = 0
    for path in files:
        if path.endswith(".json"):
            dashboards += 1
            if lint.dashboard(path):
                readable.append(path)
        else:
            rule_files += 1
            names = lint.rules(path)
            if names is not None:
                readable.append(path)
                alerts.update((name, path) for name in names)
    if alerts:
        lint.rule_tests(tests, alerts)
    lint.metric_names(readable, known, doc)

    for line in lint.failures:
        print(line)
    if lint.failures:
        print(f"lint: {len(lint.failures)} problem(s)")
        return 1
    print(f"lint: {dashboards} dashboard(s), {rule_files} rule file(s), {len(alerts)} alert(s): OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
