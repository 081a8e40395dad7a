#!/usr/bin/env python3
"""The repository's layout rules (docs/ARCHITECTURE.md, "Folders and targets"):

1. The top-level folders form the layers of LAYERS, lowest first: a file may include only from its
   own folder and the folders below it. Every top-level folder that holds sources has a place in
   the order, and the root CMakeLists.txt adds them in it.
2. No program a user runs links, even indirectly, a target that holds a test, a bench or a test
   tool (a *_test.cc or *test_util.h, a bench_*.cc, anything under a tools/ folder).
3. No folder holds more than 20 source files directly.
4. A program's folder (PROGRAM_FOLDERS) is included only by its own files: what programs share
   lives in a library folder.
5. The trainer reaches the optimizer servers through optimizer_client/: no production file under
   gpu_trainer/ includes cpu_optimizer_server/ (its tests, benches, tools and fuzz targets may, to
   compare with the servers' code or run one in process).

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
FUZZ_FILE = re.compile(r'_fuzz\.cc$|(^|/)fuzz/')
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
# The layers, lowest first: the wire API, the basics, the model's shape, the job system's library
# that programs of every layer embed (job files, the pool worker's agent, a rank's progress
# client), the optimizer server, the trainer's side of it (both front ends stand on it), the C++
# trainer, the services that control the programs below them (job controller, launcher, CLI, the
# trainer's pool worker and gpu_trainer's main()), and the PyTorch front end.
LAYERS = ['proto', 'base', 'model_spec', 'jobs', 'cpu_optimizer_server', 'optimizer_client',
          'gpu_trainer', 'services', 'python']
# Programs' folders: their headers are theirs alone (rule 4).
PROGRAM_FOLDERS = ['services/job_controller', 'services/launcher', 'services/offloadctl',
                   'services/trainer_worker']


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


def includes(root, sources):
    """(file, header) for every quoted #include of the tracked sources."""
    out = []
    for f in sources:
        with open(os.path.join(root, f), encoding='utf-8') as fh:
            out += [(f, header) for header in INCLUDE.findall(fh.read())]
    return out


def layer_violations(root, sources, included, edges):
    """Rule 1, from the #include lines and the root CMakeLists.txt; fills edges (from, to)."""
    top_levels = {f.split('/')[0] for f in sources if '/' in f}
    problems = [f'{d}/ holds sources but has no place in the layers'
                for d in sorted(top_levels - set(LAYERS))]
    for f, header in included:
        frm, to = f.split('/')[0], header.split('/')[0]
        if '/' not in f or '/' not in header or to not in top_levels or to == frm:
            continue
        edges.add((frm, to))
        if frm in LAYERS and to in LAYERS and LAYERS.index(to) > LAYERS.index(frm):
            problems.append(f'{f} includes "{header}": {to}/ is above {frm}/ in the layers')
    with open(os.path.join(root, 'CMakeLists.txt'), encoding='utf-8') as fh:
        added = re.findall(r'^add_subdirectory\((\w+)\)', fh.read(), re.M)
    added = [d for d in added if d in LAYERS]
    if added != sorted(added, key=LAYERS.index):
        problems.append(f'the root CMakeLists.txt adds {", ".join(added)}: not in the layers\' '
                        f'order')
    return problems


def program_folder_violations(included):
    """Rule 4."""
    problems = []
    for f, header in included:
        for program in PROGRAM_FOLDERS:
            if header.startswith(program + '/') and not f.startswith(program + '/'):
                problems.append(f'{f} includes "{header}": only {program}/ itself may include '
                                f'a program folder\'s headers (move what they share into a '
                                f'library folder)')
    return problems


def trainer_server_violations(included):
    """Rule 5."""
    return [f'{f} includes "{header}": the trainer reaches the optimizer servers through '
            f'optimizer_client/ (only tests, benches, tools and fuzz targets under gpu_trainer/ '
            f'may include cpu_optimizer_server/)'
            for f, header in included
            if f.startswith('gpu_trainer/') and header.startswith('cpu_optimizer_server/')
            and not TOOL_FILE.search(f) and not FUZZ_FILE.search(f)]


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
    included = includes(source_root, sources)
    edges = set()
    failures = layer_violations(source_root, sources, included, edges)
    with tempfile.TemporaryDirectory(prefix='check_layout.') as build:
        configure(source_root, build)
        failures += tool_linking_programs(source_root, build)
    failures += [f'{d} holds {n} source files directly (at most {MAX_SOURCES_PER_FOLDER})'
                 for d, n in crowded_folders(sources)]
    failures += program_folder_violations(included)
    failures += trainer_server_violations(included)
    print('layers: ' + ' < '.join(LAYERS))
    print('top-level dependencies: ' + ', '.join(f'{a} -> {b}' for a, b in sorted(edges)))
    if failures:
        for f in failures:
            print('check_layout: ' + f, file=sys.stderr)
        return 1
    print('check_layout: every include points down the layers, no program links a test or bench tool, no crowded folder, no program folder included '
          'from outside, the trainer reaches the servers only through optimizer_client/')
    return 0


if __name__ == '__main__':
    sys.exit(main())
