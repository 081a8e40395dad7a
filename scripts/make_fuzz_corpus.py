#!/usr/bin/env python3
"""Writes the fuzz targets' seed corpora (docs/RELIABILITY.md, "Fuzzing"): small valid and
near-valid inputs in each real format, next to the target that reads them:

  optimizer_client/checkpoint/fuzz/safetensors_corpus/    safetensors files
  optimizer_client/checkpoint/fuzz/manifest_corpus/       checkpoint manifests (JSON)
  optimizer_client/param_state/fuzz/param_state_manifest_corpus/  a front end's checkpoint
                                                     manifests (JSON)
  gpu_trainer/data/fuzz/token_shard_corpus/          llm.c .bin token shards
  jobs/spec/fuzz/job_spec_corpus/                    job files, YAML and JSON
  services/job_controller/fuzz/rest_gateway_corpus/  raw HTTP requests
  cpu_optimizer_server/shard/fuzz/step_session_corpus/  step streams (step_session_fuzz.cc's
                                                     encoding)

Usage: scripts/make_fuzz_corpus.py (from anywhere). Only the seeds it names are written; the
regression inputs of crashes found by fuzzing (regression-*) are kept as they are. scripts/fuzz
never writes here: it fuzzes copies.
"""
import json
import os
import struct

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..')


def write(folder, name, data):
    path = os.path.join(ROOT, folder, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(path, 'wb') as f:
        f.write(data)


# --- safetensors ---------------------------------------------------------------------------------

def safetensors(header, data=b'', pad=True, length=None):
    text = json.dumps(header, separators=(',', ':')).encode() if isinstance(header, dict) else header
    if pad:
        text += b' ' * ((8 - len(text) % 8) % 8)
    return struct.pack('<Q', len(text) if length is None else length) + text + data


def entry(dtype, shape, begin, end):
    return {'dtype': dtype, 'shape': shape, 'data_offsets': [begin, end]}


def safetensors_corpus():
    d = 'optimizer_client/checkpoint/fuzz/safetensors_corpus'
    f32 = struct.pack('<4f', 1.0, -2.0, 0.5, 3.25)
    bf16 = struct.pack('<3H', 0x3f80, 0xc000, 0x7f80)
    f16 = struct.pack('<2H', 0x3c00, 0x7e00)
    two = {'__metadata__': {'format': 'pt', 'step': '3'},
           'wte': entry('F32', [2, 2], 0, 16), 'ln.bias': entry('BF16', [3], 16, 22)}
    write(d, 'valid_two_tensors.safetensors', safetensors(two, f32 + bf16))
    write(d, 'valid_empty.safetensors', safetensors({}))
    write(d, 'valid_all_dtypes.safetensors', safetensors({
        'a': entry('F16', [2], 0, 4), 'b': entry('I32', [1], 4, 8), 'c': entry('I64', [1], 8, 16),
        'd': entry('U16', [1], 16, 18), 'e': entry('U8', [2], 18, 20), 'z': entry('F32', [0, 5], 20, 20)},
        f16 + b'\1\0\0\0' + b'\2' + b'\0' * 7 + b'\3\0' + b'\4\5'))
    write(d, 'valid_unpadded.safetensors', safetensors({'x': entry('F16', [1, 2], 0, 4)}, f16, pad=False))
    write(d, 'bad_overlap.safetensors', safetensors(
        {'a': entry('F32', [2], 0, 8), 'b': entry('F32', [2], 4, 12)}, b'\0' * 12))
    write(d, 'bad_hole.safetensors', safetensors({'a': entry('F32', [1], 4, 8)}, b'\0' * 8))
    write(d, 'bad_shape.safetensors', safetensors({'a': entry('F32', [3], 0, 8)}, b'\0' * 8))
    write(d, 'bad_dtype.safetensors', safetensors({'a': entry('F8', [1], 0, 1)}, b'\0'))
    write(d, 'bad_length.safetensors', safetensors({'a': entry('U8', [1], 0, 1)}, b'\0', length=1 << 40))
    write(d, 'bad_metadata.safetensors', safetensors({'__metadata__': {'n': 1}}))
    write(d, 'bad_huge_shape.safetensors', safetensors(
        {'a': entry('F32', [9007199254740992, 9007199254740992], 0, 0)}))
    write(d, 'bad_key.safetensors', safetensors(
        {'a': {'dtype': 'U8', 'shape': [1], 'data_offsets': [0, 1], 'x': 1}}, b'\0'))
    write(d, 'bad_json.safetensors', safetensors(b'{"a": {"dtype": "U8", "shape": [1.5]', b''))


# --- checkpoint manifest -------------------------------------------------------------------------

def manifest_corpus():
    d = 'optimizer_client/checkpoint/fuzz/manifest_corpus'
    full = {
        'format_version': 1,
        'model': {'vocab_size': 50257, 'context_length': 1024, 'num_layers': 12, 'num_heads': 12,
                  'channels': 768},
        'param_dtype': 'DTYPE_BF16', 'step': '100', 'seed': '1337',
        'partition': {'num_params': '124439808', 'padded_length': '124439808', 'world_size': 1,
                      'num_shards': 2,
                      'slices': [{'shard_index': 0, 'length': '62219904'},
                                 {'shard_index': 1, 'offset': '62219904', 'length': '62219904'}]},
        'data': {'rng_state': '18364758544493064720', 'batches_drawn': '100'},
        'loss_scale': {'scale': 1, 'clean_steps': 3},
        'schedule': {'max_lr': 0.0006, 'min_lr': 6e-05, 'warmup_steps': 10, 'total_steps': 100},
        'grad_clip': 1.0, 'model_file': 'model.safetensors',
        'shard_files': [{'shard_index': 0, 'file': 'shard-0.safetensors', 'completed_step': '100',
                         'adam_step': '99'}],
        'train_loss': 3.25, 'val_loss': 3.5,
    }
    write(d, 'valid_full.json', json.dumps(full, indent=2))  # no digests: an older checkpoint
    digests = dict(full, model_file_digest={'bytes': '248879744', 'crc32': 4275878552},
                   shard_files=[dict(full['shard_files'][0],
                                     digest={'bytes': '1493277752', 'crc32': 0})])
    write(d, 'valid_digests.json', json.dumps(digests, indent=2))
    write(d, 'valid_camel_case.json', '{"formatVersion": 1, "model": {}, "partition": {}, '
          '"paramDtype": "DTYPE_FP16", "modelFile": "m.safetensors", "trainLoss": "NaN"}')
    base = '"format_version": 1, "model": {}, "partition": {}, "param_dtype": "DTYPE_BF16"'
    write(d, 'valid_minimal.json', '{' + base + ', "model_file": "model.safetensors"}')
    write(d, 'bad_unknown_field.json', '{' + base + ', "model_file": "m", "stpe": 3}')
    write(d, 'bad_version.json', '{' + base.replace('1', '2', 1) + ', "model_file": "m"}')
    write(d, 'bad_dtype.json', '{' + base.replace('BF16', 'FP32') + ', "model_file": "m"}')
    write(d, 'bad_path.json', '{' + base + ', "model_file": "../x"}')
    write(d, 'bad_shard_file.json',
          '{' + base + ', "model_file": "m", "shard_files": [{"file": "/etc/passwd"}]}')
    write(d, 'bad_truncated.json', '{' + base)
    write(d, 'bad_digest.json', '{' + base + ', "model_file": "m", '
          '"model_file_digest": {"bytes": "8", "crc32": 4294967296}}')  # CRC past 32 bits


# --- llm.c token shards --------------------------------------------------------------------------

def param_state_manifest_corpus():
    d = 'optimizer_client/param_state/fuzz/param_state_manifest_corpus'
    digest = {'bytes': '336', 'crc32': 2006636057}
    full = {
        'format_version': 1, 'step': '12', 'adam_step': '11', 'param_dtype': 'DTYPE_FP16',
        'loss_scale': {'scale': 32768, 'clean_steps': 3, 'skipped_steps': '1'},
        'params': [{'name': 'emb.weight', 'shape': ['37', '24']},
                   {'name': 'fc.bias', 'shape': ['53']}],
        'files': [{'tensor': 'STATE_TENSOR_MASTER_WEIGHTS', 'file': 'master.safetensors',
                   'digest': digest},
                  {'tensor': 'STATE_TENSOR_EXP_AVG', 'file': 'exp_avg.safetensors',
                   'digest': digest},
                  {'tensor': 'STATE_TENSOR_EXP_AVG_SQ', 'file': 'exp_avg_sq.safetensors',
                   'digest': digest}],
        'front_end': json.dumps({'optimizer': 'AdamW', 'param_groups': [
            {'lr': 0.001, 'betas': [0.9, 0.999], 'params': ['emb.weight', 'fc.bias']}]}),
    }
    write(d, 'valid_full.json', json.dumps(full, indent=2))
    write(d, 'bad_two_files.json', json.dumps(dict(full, files=full['files'][:2])))
    write(d, 'bad_adam_after_step.json', json.dumps(dict(full, adam_step='13')))
    write(d, 'bad_no_digest.json', json.dumps(dict(full, files=[
        {k: v for k, v in f.items() if k != 'digest'} for f in full['files']])))
    write(d, 'bad_path.json', json.dumps(dict(full, files=[
        dict(full['files'][0], file='../master.safetensors')] + full['files'][1:])))
    write(d, 'bad_dtype.json', json.dumps(dict(full, param_dtype='DTYPE_FP32')))
    write(d, 'bad_unknown_field.json', json.dumps(dict(full, stpe='3')))


def shard(tokens, magic=20240520, version=1, count=None, extra=b''):
    header = [0] * 256
    header[0], header[1], header[2] = magic, version, len(tokens) if count is None else count
    return struct.pack('<256i', *header) + struct.pack(f'<{len(tokens)}H', *tokens) + extra


def token_shard_corpus():
    d = 'gpu_trainer/data/fuzz/token_shard_corpus'
    write(d, 'valid_16.bin', shard([50256, 464, 2068, 7586, 21831, 18045, 625, 262, 16931, 3290,
                                    13, 50256, 40, 1101, 257, 11]))
    write(d, 'valid_big_vocab.bin', shard([65535, 0, 50257]))
    write(d, 'empty.bin', shard([]))
    write(d, 'bad_magic.bin', shard([1, 2], magic=20240521))
    write(d, 'bad_version.bin', shard([1, 2], version=2))
    write(d, 'bad_count_more.bin', shard([1, 2], count=3))
    write(d, 'bad_count_negative.bin', shard([1, 2], count=-1))
    write(d, 'bad_odd_size.bin', shard([1, 2], extra=b'\0'))
    write(d, 'bad_truncated_header.bin', shard([])[:100])


# --- job files -----------------------------------------------------------------------------------

def job_spec_corpus():
    d = 'jobs/spec/fuzz/job_spec_corpus'
    with open(os.path.join(ROOT, 'jobs/spec/testdata/demo_job.yaml'), 'rb') as f:
        write(d, 'demo_job.yaml', f.read())
    write(d, 'full.yaml', '''# a comment
name: tiny run
model: {preset: demo, layers: 2}
data:
  path: /data/corpus.txt
  val_fraction: 0.05
  seed: 18446744073709551615
optimizer:
  algorithm: adamw
  lr: 3
  min_lr: 1e-4
  beta2: 0.95
training:
  steps: 100
  batch: 8
  microBatches: 2
  dtype: bf16
parallel:
  ranks: 2
  dpu: true
  bucket_mb: 0.5
checkpoint:
  dir: /ckpt
  resume: false
max_restarts: 3
''')
    write(d, 'full.json', '''{
  "name": "tiny run",
  "model": {"preset": "demo", "layers": 2},
  "data": {"path": "/data/corpus.txt", "valFraction": 0.05, "seed": "18446744073709551615"},
  "optimizer": {"algorithm": "adamw", "lr": 3.0, "min_lr": 0.0001, "beta2": 0.95},
  "training": {"steps": "100", "batch": 8, "micro_batches": 2, "dtype": "bf16"},
  "parallel": {"ranks": 2, "dpu": true, "bucketMb": 0.5},
  "checkpoint": {"dir": "/ckpt", "resume": false},
  "maxRestarts": 3
}
''')
    write(d, 'nan_lr.yaml', 'data: {path: /d}\noptimizer: {lr: .nan}\n')
    write(d, 'bad_unknown_field.yaml', 'name: x\ntraining: {stpes: 3}\n')
    write(d, 'bad_type.yaml', 'name: x\ntraining: {steps: [1, 2]}\n')
    write(d, 'bad_two_documents.yaml', 'a: 1\n---\nb: 2\n')
    write(d, 'bad_unclosed.json', '{"name": [')
    write(d, 'anchors.yaml', 'base: &b {steps: 3}\ntraining: *b\n')
    write(d, 'torch.yaml', '''name: torch job
torch:
  command: [python3, /data/train.py, "--steps=3"]
  working_dir: /data
  env: [HF_HOME=/data/hf, "A=b=c"]
parallel: {ranks: 2, optimizerServers: 1, transport: auto}
checkpoint: {dir: /ckpt}
max_restarts: 2
''')
    write(d, 'torch.json', '{"torch": {"command": ["sh", "-c", "exit 0"], "env": []}}\n')
    write(d, 'tenant.yaml', 'name: t\ntenant: team-a\npriority: 1000\npreemptible: false\n'
                            'data: {path: /d.txt}\n')
    write(d, 'bad_priority.yaml', 'tenant: Team A\npriority: -5\npreemptible: maybe\n')
    write(d, 'bad_torch_list.yaml', 'torch: {command: [[a], {b: c}], env: python3}\n')


# --- REST requests -------------------------------------------------------------------------------

def http(method, target, body=None, token='fuzz-token', headers=()):
    lines = [f'{method} {target} HTTP/1.1', 'Host: localhost']
    if token is not None:
        lines.append(f'Authorization: Bearer {token}')
    lines += list(headers)
    if body is not None:
        lines += ['Content-Type: application/json', f'Content-Length: {len(body.encode())}']
    return '\r\n'.join(lines) + '\r\n\r\n' + (body or '')


def rest_gateway_corpus():
    d = 'services/job_controller/fuzz/rest_gateway_corpus'
    spec = '{"name": "demo", "model": {"preset": "demo"}, "data": {"path": "/d.txt"}}'
    write(d, 'healthz.http', http('GET', '/healthz', token=None))
    write(d, 'submit.http', http('POST', '/v1/jobs', spec))
    write(d, 'list.http', http('GET', '/v1/jobs?state=RUNNING,PAUSED&page_size=10&page_token=a%20b'))
    write(d, 'get.http', http('GET', '/v1/jobs/job-1'))
    write(d, 'events.http', http('GET', '/v1/jobs/job-1/events?after_sequence=3'))
    write(d, 'cancel.http', http('POST', '/v1/jobs/job-1:cancel', '{"reason": "done"}'))
    write(d, 'pause_other.http', http('POST', '/v1/jobs/other:pause', ''))
    write(d, 'no_token.http', http('GET', '/v1/jobs', token=None))
    write(d, 'wrong_method.http', http('DELETE', '/v1/jobs'))
    write(d, 'bad_body.http', http('POST', '/v1/jobs', '{"name": "x", "stpes": 1}'))
    write(d, 'pipelined.http', http('GET', '/v1/jobs/job-1') + http('HEAD', '/v1/jobs/job-1/events'))
    write(d, 'chunked.http', 'POST /v1/jobs/job-1:resume HTTP/1.1\r\nHost: x\r\n'
          'Authorization: Bearer fuzz-token\r\nTransfer-Encoding: chunked\r\n\r\n'
          '4\r\n{"re\r\nc\r\nason": "\xc3("}\r\n0\r\n\r\n')
    write(d, 'bad_request_line.http', 'GET\r\n\r\n')
    write(d, 'expect_continue.http', http('POST', '/v1/jobs', spec, headers=['Expect: 100-continue']))
    write(d, 'gzip.http', http('GET', '/v1/jobs/job-1', headers=['Accept-Encoding: gzip, br']))
    write(d, 'range.http', http('GET', '/v1/jobs/job-1', headers=['Range: bytes=0-5,7-9']))
    write(d, 'submit_torch.http', http('POST', '/v1/jobs', '{"torch": {"command": ["python3", '
                                       '"/t.py"], "env": ["A=1"]}, "parallel": {"ranks": 2}}'))
    # Tenants: the fuzzer's tokens of tenants a (owns job-1), b and ops (admin).
    tenant_spec = ('{"name": "t", "model": {"preset": "demo"}, "data": {"path": "/d.txt"}, '
                   '"tenant": "a", "priority": 1000, "preemptible": false}')
    write(d, 'submit_tenant.http', http('POST', '/v1/jobs', tenant_spec,
                                        token='tenant-a-token-0123456789'))
    write(d, 'submit_other_tenant.http', http('POST', '/v1/jobs', tenant_spec,
                                              token='tenant-b-token-0123456789'))
    write(d, 'submit_bad_priority.http', http('POST', '/v1/jobs', tenant_spec.replace(
        '1000', '1001').replace('"a"', '"Bad Tenant"'), token='tenant-ops-token-0123456789'))
    write(d, 'get_other_tenant.http', http('GET', '/v1/jobs/job-1',
                                           token='tenant-b-token-0123456789'))
    write(d, 'audit.http', http('GET', '/v1/audit?after_sequence=2&page_size=5',
                                token='tenant-ops-token-0123456789'))
    write(d, 'audit_not_admin.http', http('GET', '/v1/audit', token='tenant-a-token-0123456789'))


# --- step streams (step_session_fuzz.cc's encoding) ---------------------------------------------

def op_open(slot, rng, delta=0):
    return bytes([0, slot, rng, delta & 0xff])


def op_grads(slot, offset, count, flags=0, seed=1):
    return bytes([1, slot, flags]) + struct.pack('<hH', offset, count) + bytes([seed])


def op_commit(slot, delta=0, lr=0, mult=0, flags=6):  # flags 6: the sink never refuses
    return bytes([2, slot, delta & 0xff, lr, mult, flags])


def op_commit_range_steps(slot, steps, flags=6):
    """A commit with range steps (flag bit 5): (offset from the range, length, t) each."""
    out = bytes([2, slot, 0, 0, 0, flags | 32, len(steps) - 1])
    for offset, length, t in steps:
        out += struct.pack('<hH', offset, length) + bytes([t])
    return out


def op_close(slot):
    return bytes([3, slot])


def op_load_chunk(tensor, rng, offset, count, flags=0, seed=3):
    return bytes([5, tensor, (flags & ~3) | rng]) + struct.pack('<hH', offset, count) + bytes([seed])


def op_read(tensor, dtype, offset, length, chunk):
    return bytes([9, tensor, dtype]) + struct.pack('<hH', offset, length) + bytes([chunk])


def op_update(slot, offset, count, t=0, lr=0, mult=0, flags=0):
    return bytes([10, slot]) + struct.pack('<hH', offset, count) + bytes([t, lr, mult, flags])


def step_session_corpus():
    d = 'cpu_optimizer_server/shard/fuzz/step_session_corpus'
    cfg = bytes([3])  # plenty of headroom, scalar path, fp16
    step0 = op_open(0, 0) + op_grads(0, 0, 300) + op_commit(0)
    write(d, 'one_step.steps', cfg + step0)
    write(d, 'two_chunks_two_steps.steps', cfg + step0 + op_open(0, 0) + op_grads(0, 0, 100) +
          op_grads(0, 100, 200, flags=1 << 2) + op_commit(0))
    write(d, 'accumulate.steps', cfg + op_open(0, 0) + op_grads(0, 0, 300, flags=1) +
          op_grads(0, 0, 300, flags=1 | 2 << 2) + op_commit(0))
    write(d, 'two_waves.steps', bytes([3 | 4 | 8]) + op_open(1, 1) + op_grads(1, 0, 16484) +
          op_commit(1, flags=2))
    write(d, 'replay.steps', cfg + step0 + op_open(0, 0, delta=-1) + op_grads(0, 0, 300) +
          op_commit(0))
    write(d, 'skip.steps', cfg + op_open(0, 2) + op_commit(0, flags=7))
    write(d, 'views.steps', cfg + op_open(1, 2) + op_grads(1, 0, 50, flags=2) +
          op_grads(1, 50, 50, flags=2) + op_commit(1))
    write(d, 'nan_refused.steps', cfg + op_open(0, 0) + op_grads(0, 0, 300, flags=16) +
          op_commit(0) + op_commit(0, flags=7))
    write(d, 'budget.steps', bytes([0]) + op_open(0, 1) + op_grads(0, 0, 16484, flags=1))
    write(d, 'load.steps', cfg + bytes([4]) + op_load_chunk(1, 0, 0, 300) +
          op_load_chunk(2, 2, 0, 100) + bytes([6, 5, 3, 7]) + op_open(0, 0) +
          op_grads(0, 0, 300) + op_commit(0))
    write(d, 'load_while_open.steps', cfg + op_open(0, 0) + bytes([4]) +
          op_load_chunk(0, 0, 0, 300) + bytes([7]) + op_close(0))
    # Two groups; range 1's second step skips a run, and gives two runs their own t, one across
    # the wave boundary.
    write(d, 'range_steps.steps', bytes([3 | 32]) + op_open(1, 1) + op_grads(1, 0, 16484) +
          op_commit(1) + op_open(1, 1) + op_grads(1, 0, 16484) +
          op_commit_range_steps(1, [(10, 100, 0), (16380, 10, 1), (16470, 14, 2)]))
    write(d, 'reads.steps', cfg + op_read(0, 1, 0, 300, 7) + op_read(1, 0, -10, 400, 0) +
          op_read(2, 2, 100, 20000, 255))
    # bf16 moments (config bit 6): an update during backward that stands, a commit, a load of
    # exp_avg (rounded to bf16) and reads of both moments.
    write(d, 'bf16_state.steps', bytes([3 | 4 | 8 | 64]) + op_open(0, 1) +
          op_grads(0, 0, 16484) + op_update(0, 0, 5000) + op_commit(0) + bytes([4]) +
          op_load_chunk(1, 1, 0, 300) + bytes([7]) + op_read(1, 0, 0, 16484, 9) +
          op_read(2, 0, 16000, 484, 0))


def main():
    safetensors_corpus()
    manifest_corpus()
    param_state_manifest_corpus()
    token_shard_corpus()
    job_spec_corpus()
    rest_gateway_corpus()
    step_session_corpus()


if __name__ == '__main__':
    main()
