#!/usr/bin/env node
// Schema checks of rendered Kubernetes objects, for tests/k8s_manifests_test.sh.
//
//   node validate.cjs NODE_MODULES_PARENT CASE=objects.json [CASE=objects.json ...]
//
// NODE_MODULES_PARENT is the directory whose node_modules/ holds the packages pinned in
// tests/k8s/package-lock.json. Each objects.json is a JSON array of the objects one
// `kubectl kustomize` rendered. For every object it
//   1. validates it with its kubernetes-models (or @kubernetes-models/prometheus-operator) model:
//      `new Deployment(obj).validate()` throws on a wrong type, a bad enum value, a missing
//      required field, a malformed quantity...;
//   2. walks it against the same OpenAPI schemas the validator used and reports every field the
//      schema does not define. The JSON schemas leave additionalProperties open, so step 1
//      accepts a misspelt field (imagePullPolcy) that the API server would drop or reject.
// It prints one line per problem, "CASE<TAB>Kind/name: message", and exits 0; a crash exits 2.
"use strict";

const path = require("path");
const fs = require("fs");
const { createRequire } = require("module");

const [, , prefix, ...cases] = process.argv;
if (!prefix || cases.length === 0) {
  console.error("usage: validate.cjs NODE_MODULES_PARENT CASE=objects.json ...");
  process.exit(2);
}
const req = createRequire(path.join(path.resolve(prefix), "package.json"));

// The models register their schemas (and those they reference) with @kubernetes-models/validate
// the first time they validate. Record them on the way: the raw schemas are what the unknown-field
// walk needs, and they are the very ones the validator compiled.
const schemas = new Map();
const validateLib = req("@kubernetes-models/validate");
const register = validateLib.register;
validateLib.register = (id, schema) => {
  schemas.set(id, schema);
  return register(id, schema);
};

function modelFor(apiVersion, kind) {
  if (typeof apiVersion !== "string" || typeof kind !== "string") return undefined;
  const slash = apiVersion.indexOf("/");
  const group = slash < 0 ? "" : apiVersion.slice(0, slash);
  const version = slash < 0 ? apiVersion : apiVersion.slice(slash + 1);
  let mod;
  try {
    mod = group === "monitoring.coreos.com"
      ? req(`@kubernetes-models/prometheus-operator/monitoring.coreos.com/${version}`)
      : req(`kubernetes-models/${group ? group + "/" : ""}${version}`);
  } catch (e) {
    return undefined;
  }
  const model = mod[kind];
  return typeof model === "function" && model.kind === kind ? model : undefined;
}

function rootSchemaId(apiVersion, kind) {
  for (const [id, s] of schemas) {
    const p = s && s.properties;
    if (p && p.kind && Array.isArray(p.kind.enum) && p.kind.enum.includes(kind) &&
        p.apiVersion && Array.isArray(p.apiVersion.enum) && p.apiVersion.enum.includes(apiVersion)) {
      return id;
    }
  }
  return undefined;
}

function resolve(schema) {
  let s = schema;
  for (let i = 0; s && s.$ref && i < 32; i++) {
    const id = s.$ref.replace(/#$/, "");
    if (!schemas.has(id)) throw new Error(`schema ${id} is not registered`);
    s = schemas.get(id);
  }
  return s;
}

function isObject(v) {
  return v !== null && typeof v === "object" && !Array.isArray(v);
}

// The schemas a value may be checked against: $ref resolved, oneOf/anyOf/allOf flattened, the
// `{type: null}` branches of nullable references dropped.
function candidates(schema) {
  const s = resolve(schema);
  if (!s || typeof s !== "object") return [];
  const alternatives = s.oneOf || s.anyOf;
  if (alternatives) {
    return alternatives.flatMap(candidates).filter((c) => c.type !== "null");
  }
  if (s.allOf) {
    const merged = { properties: {} };
    for (const part of s.allOf.flatMap(candidates)) {
      Object.assign(merged.properties, part.properties || {});
      if (part.additionalProperties !== undefined) merged.additionalProperties = part.additionalProperties;
      if (part.items !== undefined) merged.items = part.items;
    }
    return [merged];
  }
  return [s];
}

function fmt(pathParts) {
  let out = "";
  for (const p of pathParts) {
    if (typeof p === "number") out += `[${p}]`;
    else if (/^[A-Za-z_$][\w$-]*$/.test(p)) out += (out ? "." : "") + p;
    else out += `[${JSON.stringify(p)}]`;
  }
  return out || "(root)";
}

function walkOne(schema, value, pathParts, errors) {
  if (Array.isArray(value)) {
    if (schema.items) value.forEach((item, i) => walk(schema.items, item, [...pathParts, i], errors));
    return;
  }
  if (!isObject(value)) return;
  const props = schema.properties || {};
  const extra = schema.additionalProperties;
  const declared = Object.keys(props).length > 0;
  // An object schema with neither properties nor additionalProperties (RawExtension, FieldsV1,
  // x-kubernetes-preserve-unknown-fields) is free-form.
  if (!declared && (extra === undefined || extra === true)) return;
  for (const [key, child] of Object.entries(value)) {
    if (Object.prototype.hasOwnProperty.call(props, key)) {
      walk(props[key], child, [...pathParts, key], errors);
    } else if (isObject(extra)) {
      walk(extra, child, [...pathParts, key], errors);
    } else if (extra !== true) {
      errors.push(`${fmt([...pathParts, key])}: unknown field`);
    }
  }
}

function walk(schema, value, pathParts, errors) {
  if (value === null || typeof value !== "object") return;
  const options = candidates(schema).filter((c) =>
    Array.isArray(value) ? c.items || c.type === "array" : c.properties || c.additionalProperties || c.type === "object");
  if (options.length === 0) return;
  let first;
  for (const option of options) {
    const errs = [];
    walkOne(option, value, pathParts, errs);
    if (errs.length === 0) return;
    if (!first) first = errs;
  }
  errors.push(...first);
}

function checkObject(obj) {
  const problems = [];
  if (!isObject(obj)) return ["not an object"];
  const { apiVersion, kind } = obj;
  const Model = modelFor(apiVersion, kind);
  if (!Model) return [`no schema for apiVersion ${apiVersion} kind ${kind}`];
  try {
    new Model(obj).validate();
  } catch (e) {
    const errs = e && e.errors;
    if (Array.isArray(errs) && errs.length) {
      for (const err of errs) {
        const parts = (err.instancePath || "").split("/").slice(1)
          .map((p) => p.replace(/~1/g, "/").replace(/~0/g, "~"))
          .map((p) => (/^\d+$/.test(p) ? Number(p) : p));
        const where = fmt(parts);
        problems.push(`schema: ${where}: ${err.message}${err.params && err.params.allowedValues ? " " + JSON.stringify(err.params.allowedValues) : ""}`);
      }
    } else {
      problems.push(`schema: ${e && e.message ? e.message : e}`);
    }
  }
  const rootId = rootSchemaId(apiVersion, kind);
  if (!rootId) {
    problems.push(`no registered schema for ${apiVersion} ${kind} (cannot check for unknown fields)`);
  } else {
    const errs = [];
    walk({ $ref: `${rootId}#` }, obj, [], errs);
    problems.push(...errs);
  }
  return problems;
}

for (const arg of cases) {
  const eq = arg.indexOf("=");
  const name = arg.slice(0, eq);
  const file = arg.slice(eq + 1);
  const objects = JSON.parse(fs.readFileSync(file, "utf8"));
  if (!Array.isArray(objects) || objects.length === 0) {
    console.log(`${name}\t(all): no objects rendered`);
    continue;
  }
  for (const obj of objects) {
    const id = `${obj && obj.kind}/${obj && obj.metadata && obj.metadata.name}`;
    for (const problem of checkObject(obj)) console.log(`${name}\t${id}: ${problem}`);
  }
}
