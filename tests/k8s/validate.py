"""Schema checks of rendered Kubernetes objects, for tests/k8s_manifests_test.sh.

  validate.py --kubernetes 1.27,1.37 CASE=objects.json [CASE=objects.json ...]

Runs in the virtual environment the test installs from tests/k8s/requirements.txt. Each
objects.json is a JSON array of the objects one `kubectl kustomize` rendered (written by
check_manifests.py). Every object is validated with jsonschema (Draft 2020-12) against
  - for the Kubernetes kinds: the "strict" JSON schemas that kubernetes-validate ships for each
    Kubernetes version given (additionalProperties: false on every object: a misspelt
    imagePullPolcy is an error), checked against every version given, so an object must be valid
    from the oldest to the newest;
  - for monitoring.coreos.com (the Prometheus Operator): the JSON schema of the
    cloudcoil-models-prometheus-operator model of the kind (pydantic models generated from the
    operator's CRDs: types, enums, patterns, required fields), closed here with
    additionalProperties: false on every object that declares properties (the models ignore
    unknown fields, the API server drops or rejects them).
A kind with no schema is an error, not a skip. It prints one line per problem,
"CASE<TAB>Kind/name: message" (a schema error "schema: PATH: message", an unknown field
"PATH: unknown field", with "(Kubernetes X)" appended when not every version reports it), and
exits 0; a crash exits 2.
"""
import argparse
import importlib
import json
import re
import sys
from functools import lru_cache
from importlib import resources

import jsonschema
import referencing
from referencing.jsonschema import DRAFT202012

# API groups served by CRDs, and the package whose models carry their schemas.
CRD_MODELS = {"monitoring.coreos.com": "cloudcoil.models.prometheus_operator"}


# --- schemas ------------------------------------------------------------------------------------
def schema_dir(version):
    path = resources.files("kubernetes_validate") / "kubernetes-json-schema" / f"v{version}.0-local-strict"
    if not path.is_dir():
        raise SystemExit(f"kubernetes-validate has no schemas for Kubernetes {version}")
    return path


@lru_cache(maxsize=None)
def k8s_registry(version):
    definitions = json.loads((schema_dir(version) / "_definitions.json").read_text(encoding="utf-8"))
    return referencing.Registry().with_resource(definitions["$id"], DRAFT202012.create_resource(definitions))


@lru_cache(maxsize=None)
def k8s_validator(version, api_version, kind):
    # kubernetes-validate's file names: rbac.authorization.k8s.io/v1 Role -> role-rbac-v1.json.
    file = "%s-%s.json" % (kind.lower(), re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version))
    path = schema_dir(version) / file
    if not path.is_file():
        return None
    schema = json.loads(path.read_text(encoding="utf-8"))
    group, _, ver = api_version.rpartition("/")
    if {"group": group, "version": ver, "kind": kind} not in schema.get("x-kubernetes-group-version-kind", []):
        return None  # the file name matched another group's kind
    return jsonschema.Draft202012Validator(schema, registry=k8s_registry(version))


def close_objects(node):
    """additionalProperties: false on every object schema that lists its properties."""
    if isinstance(node, dict):
        if isinstance(node.get("properties"), dict) and "additionalProperties" not in node:
            node["additionalProperties"] = False
        for value in node.values():
            close_objects(value)
    elif isinstance(node, list):
        for value in node:
            close_objects(value)
    return node


@lru_cache(maxsize=None)
def crd_validator(api_version, kind):
    group, _, ver = api_version.rpartition("/")
    try:
        module = importlib.import_module(f"{CRD_MODELS[group]}.{ver}")
    except ImportError:
        return None
    model = getattr(module, kind, None)
    fields = getattr(model, "model_fields", {})
    if "api_version" not in fields or "kind" not in fields:
        return None
    if (fields["api_version"].default, fields["kind"].default) != (api_version, kind):
        return None
    schema = close_objects(model.model_json_schema(by_alias=True, mode="validation"))
    return jsonschema.Draft202012Validator(schema)


# --- messages -----------------------------------------------------------------------------------
def fmt(parts):
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif re.fullmatch(r"[A-Za-z_$][\w$-]*", p):
            out += ("." if out else "") + p
        else:
            out += f"[{json.dumps(p)}]"
    return out or "(root)"


def types_of(error):
    types = error.validator_value
    return [types] if isinstance(types, str) else list(types)


def messages(error):
    """(path, message, is_unknown_field) for one jsonschema error, anyOf/oneOf unfolded."""
    path = list(error.absolute_path)
    v = error.validator
    if v == "additionalProperties" and error.validator_value is False:
        props = error.schema.get("properties", {})
        patterns = error.schema.get("patternProperties", {})
        for key in error.instance:
            if key not in props and not any(re.search(p, key) for p in patterns):
                yield path + [key], "unknown field", True
    elif v == "required":
        for key in error.validator_value:
            if key not in error.instance:
                yield path, f"must have required property '{key}'", False
    elif v == "type":
        yield path, "must be " + ",".join(t for t in types_of(error) if t != "null"), False
    elif v == "enum":
        yield path, f"must be equal to one of the allowed values {json.dumps(error.validator_value)}", False
    elif v == "const":
        yield path, f"must be equal to constant {json.dumps(error.validator_value)}", False
    elif v == "pattern":
        yield path, f'must match pattern "{error.validator_value}"', False
    elif v in ("anyOf", "oneOf") and error.context:
        # The branches that fail only on the value's type at this path are not what was meant;
        # when every branch does, say which types would do.
        branches = {}
        for e in error.context:
            branches.setdefault(e.schema_path[0], []).append(e)
        meant = [errs for errs in branches.values()
                 if not all(e.validator == "type" and list(e.absolute_path) == path for e in errs)]
        if not meant:
            types = []
            for e in error.context:
                types += [t for t in types_of(e) if t != "null" and t not in types]
            yield path, "must be " + ",".join(types), False
        else:
            for e in meant[0]:
                yield from messages(e)
    else:
        yield path, error.message, False


def problems_of(validator, obj):
    out = []
    for error in validator.iter_errors(obj):
        for path, message, unknown in messages(error):
            line = f"{fmt(path)}: {message}" if unknown else f"schema: {fmt(path)}: {message}"
            if line not in out:
                out.append(line)
    return out


def check_object(obj, versions):
    if not isinstance(obj, dict):
        return ["not an object"]
    api_version, kind = obj.get("apiVersion"), obj.get("kind")
    if not isinstance(api_version, str) or not isinstance(kind, str):
        return [f"no schema for apiVersion {api_version} kind {kind}"]
    group = api_version.rpartition("/")[0]
    if group in CRD_MODELS:
        validator = crd_validator(api_version, kind)
        if validator is None:
            return [f"no schema for apiVersion {api_version} kind {kind} in {CRD_MODELS[group]}"]
        return problems_of(validator, obj)
    found = {}  # problem -> the versions that report it
    for version in versions:
        validator = k8s_validator(version, api_version, kind)
        problems = ([f"no schema for apiVersion {api_version} kind {kind}"] if validator is None
                    else problems_of(validator, obj))
        for problem in problems:
            found.setdefault(problem, []).append(version)
    return [p if len(vs) == len(versions) else f"{p} (Kubernetes {', '.join(vs)})"
            for p, vs in found.items()]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--kubernetes", required=True,
                        help="comma-separated Kubernetes versions (major.minor) to validate against")
    parser.add_argument("cases", nargs="+", metavar="CASE=objects.json")
    args = parser.parse_args()
    versions = args.kubernetes.split(",")
    for version in versions:
        schema_dir(version)
    for arg in args.cases:
        name, _, file = arg.partition("=")
        with open(file, encoding="utf-8") as f:
            objects = json.load(f)
        if not isinstance(objects, list) or not objects:
            print(f"{name}\t(all): no objects rendered")
            continue
        for obj in objects:
            meta = obj.get("metadata") if isinstance(obj, dict) else None
            oid = f"{obj.get('kind') if isinstance(obj, dict) else None}/{meta.get('name') if isinstance(meta, dict) else None}"
            for problem in check_object(obj, versions):
                print(f"{name}\t{oid}: {problem}")


if __name__ == "__main__":
    try:
        main()
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - a crash must not read as "no problems"
        import traceback
        traceback.print_exc()
        sys.exit(2)
