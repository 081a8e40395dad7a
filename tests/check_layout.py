#!/usr/bin/env python3
"""The repository's layout rules (docs/ARCHITECTURE.md, "Folders and targets"):

1. The top-level folders depend on each other, by their #include lines, without a cycle.
2. No program a user runs links, even indirectly, a target that holds a test, a bench or a test
   tool (a *_test.cc or *test_util.h, a bench_*.cc, anything under a tools/ folder).
3. No folder holds more than 20 source files directly.

Usage: check_layout.py SOURCE_DIR. Rule 2 reads the targets and their sources through CMake's
file API, from a configure of SOURCE_DIR into a temporary directory (a few seconds; the query must
exist before CMake runs, so a build directory's own configure cannot answer it). Exits 1 naming
every violation.
"""
import json
import os
import re
import subprocess
import sys
import tempfile

SOURCE_EXTENSIONS = ('.cc', '.h', '.cu', '.cuh')
MAX_SOURCES_PER_FOLDER = 20
TOOL_FILE = re.compile(r'(_test\.cc|test_util\.h)$|(^|/)bench_[^/]*\.cc$|(^|/)tools/')
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def tracked_sources(root):
    try:
        files = subprocess.check_output(['git', 'ls-files'], cwd=root, text=True,
                                        stderr=subprocess.DEVNULL).split()
    except (OSError, subprocess.CalledProcessError):  # a source tree without git
        files = []
        for d, dirs, names in os.walk(root):
            dirs[:] = [x for x in dirs if not x.startswith(('.', 'build'))]
            files += [os.path.relpath(os.path.join(d, n), root) for n in names]
    return [f for f in files if f.endswith(SOURCE_EXTENSIONS)]


def folder_cycles(root, sources):
    """Edges between top-level folders from the #include lines, and a cycle if there is one."""
    top_levels = {f.split('/')[0] for f in sources if '/' in f}
    edges = {}  # (from, to) -> an example "file includes header"
    for f in sources:
        if '/' not in f:
            continue
        with open(os.path.join(root, f), encoding='utf-8') as fh:
            text = fh.read()
        for header in INCLUDE.findall(text):
            to = header.split('/')[0]
            frm = f.split('/')[0]
            if to in top_levels and to != frm and '/' in header:
                edges.setdefault((frm, to), f'{f} includes "{header}"')
    graph = {}
    for frm, to in edges:
        graph.setdefault(frm, set()).add(to)
    # Depth-first search for a back edge; returns the first cycle as a list of folders.
    state = {}

    def visit(node, path):
        state[node] = 'open'
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 'open':
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt, path)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 'done'
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node, [])
            if cycle:
                return edges, cycle
    return edges, None


def configure(source_root, build):
    """Configures the project into `build` with a codemodel query in place."""
    query = os.path.join(build, '.cmake', 'api', 'v1', 'query')
    os.makedirs(query)
    open(os.path.join(query, 'codemodel-v2'), 'w').close()
    run = subprocess.run(['cmake', '-S', source_root, '-B', build, '-G', 'Ninja',
                          '-DCMAKE_BUILD_TYPE=Release'], capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit('check_layout: cmake failed:\n' + run.stdout + run.stderr)


def codemodel_targets(build):
    reply = os.path.join(build, '.cmake', 'api', 'v1', 'reply')
    index = sorted(f for f in os.listdir(reply) if f.startswith('index-'))[-1]
    with open(os.path.join(reply, index)) as fh:
        index_json = json.load(fh)
    codemodel_file = index_json['reply']['codemodel-v2']['jsonFile']
    with open(os.path.join(reply, codemodel_file)) as fh:
        codemodel = json.load(fh)
    targets = {}
    for configuration in codemodel['configurations']:
        for ref in configuration['targets']:
            with open(os.path.join(reply, ref['jsonFile'])) as fh:
                t = json.load(fh)
            targets[t['id']] = t
    return targets


def tool_linking_programs(source_root, build):
    targets = codemodel_targets(build)
    root = os.path.realpath(source_root)

    def tool_files(t):
        out = []
        for s in t.get('sources', []):
            path = s['path']
            if os.path.isabs(path):
                path = os.path.relpath(os.path.realpath(path), root)
            if not path.startswith('..') and TOOL_FILE.search(path):
                out.append(path)
        return out

    tools = {tid: tool_files(t) for tid, t in targets.items()}
    tools = {tid: files for tid, files in tools.items() if files}
    problems = []
    for tid, t in targets.items():
        if t['type'] != 'EXECUTABLE' or tid in tools:
            continue
        # Everything this program is built from, transitively.
        seen, stack, via = set(), [tid], {}
        while stack:
            cur = stack.pop()
            for dep in targets[cur].get('dependencies', []):
                if dep['id'] not in seen:
                    seen.add(dep['id'])
                    via[dep['id']] = cur
                    stack.append(dep['id'])
        for dep in sorted(seen & tools.keys()):
            chain, cur = [], dep
            while cur != tid:
                chain.append(targets[cur]['name'])
                cur = via[cur]
            problems.append(f'program {t["name"]} links {" <- ".join(chain)}, which holds '
                            f'{", ".join(tools[dep][:3])}')
    return problems


def crowded_folders(sources):
    counts = {}
    for f in sources:
        counts[os.path.dirname(f)] = counts.get(os.path.dirname(f), 0) + 1
    return sorted((d or '.', n) for d, n in counts.items() if n > MAX_SOURCES_PER_FOLDER)


def main():
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    source_root = sys.argv[1]
    sources = tracked_sources(source_root)
    failures = []
    edges, cycle = folder_cycles(source_root, sources)
    if cycle:
        steps = [f'  {a} -> {b}: {edges[(a, b)]}' for a, b in zip(cycle, cycle[1:])]
        failures.append('the top-level folders depend on each other in a cycle:\n' +
                        '\n'.join(steps))
    with tempfile.TemporaryDirectory(prefix='check_layout.') as build:
        configure(source_root, build)
        failures += tool_linking_programs(source_root, build)
    failures += [f'{d} holds {n} source files directly (at most {MAX_SOURCES_PER_FOLDER})'
                 for d, n in crowded_folders(sources)]
    order = sorted({b for _, b in edges} | {a for a, _ in edges})
    print('top-level dependencies: ' +
          ', '.join(f'{a} -> {b}' for a, b in sorted(edges)) + f' ({len(order)} folders)')
    if failures:
        for f in failures:
            print('check_layout: ' + f, file=sys.stderr)
        return 1
    print('check_layout: no cycle, no program links a test or bench tool, no crowded folder')
    return 0


if __name__ == '__main__':
    sys.exit(main())
