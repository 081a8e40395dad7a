"""Queries a running Prometheus for every expression of the dashboards and rules.

Input: the JSON lines of monitoring/tools/queries.py on stdin. A dashboard expression must
return data as written (with Grafana's variables substituted); a rule expression must evaluate,
and every metric it names must return data (a healthy run fires no alert, so the rule itself is
usually empty). Prints one line per expression and exits 1 if any fails.
"""
import json
import sys
import urllib.parse
import urllib.request


def query(base, expr):
    url = base + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            body = json.load(response)
    except urllib.error.HTTPError as e:
        body = json.load(e)
    if body.get("status") != "success":
        return None, body.get("error", "unknown error")
    return body["data"]["result"], None


def main():
    base = sys.argv[1]
    failures = 0
    count = 0
    for line in sys.stdin:
        if not line.strip():
            continue
        q = json.loads(line)
        count += 1
        result, error = query(base, q["expr"])
        if error is not None:
            print(f"FAIL {q['source']}: {q['expr']}: {error}")
            failures += 1
            continue
        if q["kind"] == "dashboard":
            if not result:
                print(f"FAIL {q['source']}: no data for {q['expr']}")
                failures += 1
            else:
                print(f"ok   {q['source']}: {len(result)} series")
            continue
        missing = []
        for name in q["selectors"]:
            series, err = query(base, f"count({name})")
            if err is not None or not series:
                missing.append(name)
        if missing:
            print(f"FAIL {q['source']}: no data for {', '.join(missing)}")
            failures += 1
        else:
            print(f"ok   {q['source']}: evaluates; {', '.join(q['selectors'])} have data")
    if count == 0:
        print("FAIL no expressions to check")
        return 1
    print(f"{count - failures} of {count} expressions pass")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
