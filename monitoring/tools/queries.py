#!/usr/bin/python3
"""Lists every PromQL expression of the Grafana dashboards and the Prometheus rule files.

One JSON object a line:
    {"source": "<file>:<panel title or alert name>", "expr": "...",
     "kind": "dashboard" | "rule", "selectors": ["metric_name", ...]}

Dashboard expressions have their Grafana variables replaced so a plain Prometheus can run them:
the dashboard's own variables ($job, ${instance}, ...; they only appear inside =~ matchers)
become `.*`, $__rate_interval `1m`, $__interval `30s`, $__range `5m`. A query variable
`label_values(SELECTOR, label)` is listed as SELECTOR (source "<file>:variable <name>"): the
variable has options exactly when that selector returns data.

`selectors` are the metric names an expression reads (see metric_names()).
`--metrics` prints the sorted set of all of them instead, one a line.

Used by monitoring/tools/lint.py (every name must be in docs/METRICS.md) and by
tests/prometheus_test.sh (every dashboard expression, and every metric a rule reads, must
return data from a real run). Standard library plus PyYAML (python3-yaml).
"""

import argparse
import glob
import json
import os
import re
import signal
import sys

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))

# Grafana's built-in interval variables, replaced with what they would be at a 15s scrape
# interval over a short time range.
BUILTINS = {"__rate_interval": "1m", "__interval": "30s", "__range": "5m"}

# Words that are PromQL syntax, not metric names.
AGGREGATIONS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count",
                "count_values", "bottomk", "topk", "quantile", "limitk", "limit_ratio"}
# Keywords followed by a parenthesised list of label names.
LABEL_LIST_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
KEYWORDS = AGGREGATIONS | LABEL_LIST_KEYWORDS | {
    "and", "or", "unless", "bool", "offset", "atan2", "inf", "nan", "start", "end"}

TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<comment>\#[^\n]*)
  | (?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
  | (?P<number>(?:0[xX][0-9a-fA-F]+|\d+\.?\d*(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?)
               (?:[a-zA-Z]+\d*)*)      # a trailing unit makes it a duration: 5m, 1h30m
  | (?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)
  | (?P<open>[({\[])
  | (?P<close>[)}\]])
  | (?P<other>[^\s\w"'`(){}\[\]]+|,)
""", re.X)

VARIABLE = re.compile(r"\$(?:\{([A-Za-z_]\w*)(?::\w+)?\}|([A-Za-z_]\w*))")


class QueryError(Exception):
    pass


def tokens(expr):
    pos = 0
    while pos < len(expr):
        m = TOKEN.match(expr, pos)
        if not m:
            raise QueryError(f"cannot read PromQL at {expr[pos:pos + 20]!r} in {expr!r}")
        pos = m.end()
        if m.lastgroup not in ("space", "comment"):
            yield m.lastgroup, m.group()


def selectors(expr):
    """[(metric name, matchers text or None)] for every vector selector with a metric name.

    An identifier is a metric name unless it is a keyword, a function (followed by "("), a
    label name (inside {...} or in the list after by/without/on/ignoring/group_*), or a
    duration (inside [...] or after offset: those lex as numbers). Strings are skipped whole,
    so label values and label_replace()'s arguments never count. Selectors that name their
    metric only through {__name__=...} are not recognised (none of ours do that).
    """
    toks = list(tokens(expr))
    out = []
    i = 0
    while i < len(toks):
        kind, text = toks[i]
        nxt = toks[i + 1] if i + 1 < len(toks) else (None, None)
        if kind == "open" and text in "{[":
            i = skip_group(toks, i)  # label matchers of a bare {...} selector, or a range
            continue
        if kind == "ident":
            if text in LABEL_LIST_KEYWORDS:
                i = skip_group(toks, i + 1) if nxt == ("open", "(") else i + 1
                continue
            if text in KEYWORDS or nxt == ("open", "("):
                i += 1
                continue
            matchers = None
            j = i + 1
            if nxt == ("open", "{"):
                end = skip_group(toks, i + 1)
                matchers = " ".join(t for _, t in toks[i + 2:end - 1])
                j = end
            out.append((text, matchers))
            i = j
            continue
        i += 1
    return out


def skip_group(toks, i):
    """Index after the bracketed group that opens at toks[i]."""
    depth = 0
    for j in range(i, len(toks)):
        kind = toks[j][0]
        if kind == "open":
            depth += 1
        elif kind == "close":
            depth -= 1
            if depth == 0:
                return j + 1
    raise QueryError("unbalanced brackets in " + " ".join(t for _, t in toks))


def metric_names(expr):
    """Sorted, de-duplicated metric names EXPR reads."""
    return sorted({name for name, _ in selectors(expr)})


def substitute(expr, variables):
    """Replaces Grafana variables; unknown ones raise QueryError (a typo in a dashboard)."""
    def repl(m):
        name = m.group(1) or m.group(2)
        if name in BUILTINS:
            return BUILTINS[name]
        if name in variables:
            return ".*"
        raise QueryError(f"unknown Grafana variable ${name}")
    return VARIABLE.sub(repl, expr)


def walk_panels(panels):
    for panel in panels or []:
        yield panel
        yield from walk_panels(panel.get("panels"))  # panels inside a collapsed row


def label_values_selector(query):
    """SELECTOR of label_values(SELECTOR, label), or None for label_values(label)."""
    m = re.fullmatch(r"\s*label_values\((.*),\s*[A-Za-z_]\w*\s*\)\s*", query, re.S)
    return m.group(1).strip() if m else None


def dashboard_queries(path, source_name):
    """Yields (source, expr, error): error is a QueryError for an expression whose variables
    cannot be replaced (expr is then the raw text), else None."""
    with open(path) as f:
        dash = json.load(f)
    variables = {v.get("name") for v in dash.get("templating", {}).get("list", [])}

    def item(source, expr):
        try:
            return source, substitute(expr, variables), None
        except QueryError as e:
            return source, expr, e

    for var in dash.get("templating", {}).get("list", []):
        if var.get("type") != "query":
            continue
        query = var.get("query")
        if isinstance(query, dict):  # newer Grafana stores {"query": ..., "refId": ...}
            query = query.get("query")
        selector = label_values_selector(query or "")
        if selector:
            yield item(f"{source_name}:variable {var.get('name')}", selector)
    for panel in walk_panels(dash.get("panels")):
        for target in panel.get("targets") or []:
            expr = target.get("expr")
            if expr:
                yield item(f"{source_name}:{panel.get('title')}", expr)


def rule_queries(path, source_name):
    with open(path) as f:
        doc = yaml.safe_load(f) or {}
    for group in doc.get("groups") or []:
        for rule in group.get("rules") or []:
            name = rule.get("alert") or rule.get("record")
            yield f"{source_name}:{name}", str(rule.get("expr", "")).strip(), None


def default_files(root):
    return (sorted(glob.glob(os.path.join(root, "monitoring/grafana/dashboards/*.json")))
            + sorted(glob.glob(os.path.join(root, "monitoring/prometheus/rules/*.yml"))))


def display_path(path, root):
    """PATH relative to the repository root when it is inside it, else as given."""
    rel = os.path.relpath(path, root)
    return path if rel.startswith("..") else rel


def entries(files, root, errors=None):
    """Yields the dicts this script prints, for dashboard (.json) and rule (.yml) FILES.

    An expression that cannot be read raises QueryError naming its source, or, when ERRORS is
    a list, is appended to it as (source, message) and skipped.
    """
    for path in files:
        source_name = display_path(path, root)
        if path.endswith(".json"):
            kind, queries = "dashboard", dashboard_queries(path, source_name)
        else:
            kind, queries = "rule", rule_queries(path, source_name)
        for source, expr, error in queries:
            if error is None:
                try:
                    names = metric_names(expr)
                except QueryError as e:
                    error = e
            if error is not None:
                if errors is None:
                    raise QueryError(f"{source}: {error}")
                errors.append((source, str(error)))
                continue
            yield {"source": source, "expr": expr, "kind": kind, "selectors": names}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="*",
                        help="dashboards (.json) and rule files (.yml); default: all of "
                             "monitoring/grafana/dashboards and monitoring/prometheus/rules")
    parser.add_argument("--root", default=DEFAULT_ROOT, help="repository root")
    parser.add_argument("--metrics", action="store_true",
                        help="print the sorted set of metric names instead")
    args = parser.parse_args()
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # quiet under `| head`
    files = args.files or default_files(args.root)
    try:
        items = list(entries(files, args.root))
    except (QueryError, OSError, ValueError, yaml.YAMLError) as e:
        print(f"queries.py: {e}", file=sys.stderr)
        return 1
    if args.metrics:
        for name in sorted({n for item in items for n in item["selectors"]}):
            print(name)
    else:
        for item in items:
            print(json.dumps(item))
    return 0


if __name__ == "__main__":
    sys.exit(main())
