"""Benchmark harness and suites: correctness of what they compute, not speed."""

import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from memjax.bench import flops
from memjax.bench import harness
from memjax.bench import hlo
from memjax.bench import workload
from memjax.bench.suites import programs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize('extra', [{}, {'cutoffs': (64, 128), 'div_val': 2},
                                   {'memory': 'lamemo', 'n_layer': 2, 'mem_len': 24},
                                   {'memory': 'lamemo', 'lamemo_look_ahead': False},
                                   {'memory': 'infinity', 'segment_len': 16, 'ltm_basis': 24},
                                   {'memory': 'infinity', 'segment_len': 16, 'ltm_basis': 24, 'ltm_sticky': True}],
                         ids=['plain', 'adaptive', 'lamemo', 'lamemo_no_look_ahead', 'infinity', 'infinity_sticky'])
def test_analytic_flops_match_xla_cost_analysis(extra):
    # Dropout off: XLA would also count its random-bit generation, which is not model work.
    mcfg = workload.model_config(None, **{**dict(d_model=64, n_layer=1, n_head=2, d_head=32, d_inner=256,
                                                 mem_len=16, dropout=0.0), **extra})
    compiled = workload.compile_step(workload.build(mcfg, batch_size=4, tgt_len=16))
    ratio = compiled.flops / (flops.train_step_flops(mcfg, 4, 16) + flops.tail_recompute_flops(mcfg, 4, 16))
    assert 0.9 < ratio < 1.1, ratio


def test_forward_flops_of_one_layer_by_hand():
    mcfg = workload.model_config(None, d_model=8, n_layer=1, n_head=2, d_head=4, d_inner=16,
                                 mem_len=3, vocab_size=10)
    b, t, k = 2, 5, 8  # k = mem_len + tgt_len
    expected = (2 * b * t * 8 * 8  # query
                + 2 * 2 * b * k * 8 * 8  # key, value over memory + segment
                + 2 * k * 8 * 8  # positional projection, shared by the batch
                + 3 * 2 * b * 2 * t * k * 4  # content scores, position scores, weighted values
                + 2 * b * t * 8 * 8  # output projection
                + 2 * 2 * b * t * 8 * 16  # feed-forward
                + 2 * b * t * 8 * 10)  # logits
    assert sum(flops.forward_flops(mcfg, b, t).values()) == expected
    no_input_gradient = (2 * 2 * b * 3 * 8 * 8  # key, value projections of the 3 memory rows
                         + 2 * k * 8 * 8)  # positional projection of the constant sinusoids
    assert flops.train_step_flops(mcfg, b, t) == 3 * expected - no_input_gradient


def test_forward_flops_of_a_gpt2_layer_by_hand():
    """Learned absolute positions are added to the embeddings: no positional keys or scores."""
    mcfg = workload.model_config(None, d_model=8, n_layer=1, n_head=2, d_head=4, d_inner=16, mem_len=0,
                                 vocab_size=10, memory='none', block='gpt2', positions='learned_absolute',
                                 pre_lnorm=True)
    b, t = 2, 5
    expected = (2 * b * t * 8 * 8  # query
                + 2 * 2 * b * t * 8 * 8  # key, value over the segment
                + 2 * 2 * b * 2 * t * t * 4  # content scores, weighted values
                + 2 * b * t * 8 * 8  # output projection
                + 2 * 2 * b * t * 8 * 16  # feed-forward
                + 2 * b * t * 8 * 10)  # logits
    assert sum(flops.forward_flops(mcfg, b, t).values()) == expected
    assert flops.train_step_flops(mcfg, b, t) == 3 * expected


class _FakeTime:
    """A clock that only moves when the timed function runs, by a scripted duration."""

    def __init__(self, durations):
        self.now = 0.0
        self.durations = list(durations)
        self.calls = 0

    def clock(self):
        return self.now

    def fn(self, value):
        self.now += self.durations[self.calls]
        self.calls += 1
        return value


def test_time_fn_reports_the_median_of_the_timed_runs():
    fake = _FakeTime([100.0, 50.0, 7.0, 1.0, 3.0, 9.0, 2.0])  # The first two are warm-up.
    timing = harness.time_fn(fake.fn, 1.0, warmup=2, repeats=5, clock=fake.clock)
    assert fake.calls == 7
    assert timing.times_s == (7.0, 1.0, 3.0, 9.0, 2.0)
    assert timing.median_s == 3.0 and timing.min_s == 1.0 and timing.max_s == 9.0


def test_time_interleaved_alternates_and_attributes_each_run():
    order = []
    clock = [0.0]

    def fn(name, duration):
        def call():
            order.append(name)
            clock[0] += duration
            return duration
        return call

    timings = harness.time_interleaved({'a': fn('a', 2.0), 'b': fn('b', 5.0)}, warmup=1, repeats=3,
                                       clock=lambda: clock[0])
    assert order == ['a', 'b'] + ['a', 'b'] * 3  # warm-up of each, then rounds
    assert timings['a'].times_s == (2.0, 2.0, 2.0) and timings['b'].times_s == (5.0, 5.0, 5.0)

    # With settle, each timed call follows an untimed one of the same function: a slower first
    # call after a switch (here 3 s longer) is never the one timed.
    order.clear()
    last = [None]

    def switching(name, duration):
        def call():
            order.append(name)
            clock[0] += duration + (3.0 if last[0] != name else 0.0)
            last[0] = name
        return call

    timings = harness.time_interleaved({'a': switching('a', 2.0), 'b': switching('b', 5.0)}, warmup=0, repeats=2,
                                       clock=lambda: clock[0], settle=1)
    assert order == ['a', 'a', 'b', 'b'] * 2
    assert timings['a'].times_s == (2.0, 2.0) and timings['b'].times_s == (5.0, 5.0)


def test_compile_fn_times_lowering_and_compilation_separately():
    ticks = iter([10.0, 12.5, 20.0])
    compiled = harness.compile_fn(lambda x: x * 2.0, 1.0, clock=lambda: next(ticks))
    assert (compiled.lower_s, compiled.compile_s) == (2.5, 7.5)
    assert float(compiled.executable(3.0)) == 6.0


def test_registry_rejects_unknown_and_duplicate_suites():
    assert {'peak', 'train', 'compile', 'memory', 'devices'} <= set(harness.available_suites())
    with pytest.raises(harness.BenchError, match='unknown benchmark suite'):
        harness.get_suite('no-such-suite')
    harness.get_suite('peak')
    with pytest.raises(harness.BenchError, match='registered twice'):
        harness.register('peak')(lambda ctx: None)


def test_context_rejects_bad_settings():
    with pytest.raises(harness.BenchError, match='--size'):
        harness.Context(size='huge')
    with pytest.raises(harness.BenchError, match=r'^--repeats=0 must be >= 1\.$'):  # Only what is wrong.
        harness.Context(repeats=0)
    with pytest.raises(harness.BenchError, match=r'^--warmup=-1 must be >= 0\. --repeats=0 must be >= 1\.$'):
        harness.Context(warmup=-1, repeats=0)


def test_format_table_aligns_every_row():
    table = harness.format_table([{'a': 1, 'b': 0.5}, {'a': 22, 'b': None}], ('a', 'b'))
    lines = table.splitlines()
    assert lines[0].startswith('| a ') and len({len(line) for line in lines}) == 1
    assert '| 22 | -   |' in table


def _check_peak(report):
    rows = report['rows']
    assert {r['dtype'] for r in rows} == {'float32', 'bfloat16'}
    for r in rows:
        assert math.isclose(r['gflop'], 2 * r['batch'] * r['m'] * r['k'] * r['n'] / 1e9)
    assert report['figures']['peak_gflops_per_s_float32'] == max(
        r['gflops_per_s'] for r in rows if r['dtype'] == 'float32')


def _check_train(report):
    assert len(report['rows']) == 3
    for r in report['rows']:
        assert math.isclose(r['tokens_per_s'], r['batch'] * r['tgt_len'] / (r['step_ms'] / 1e3), rel_tol=1e-6)
        assert math.isclose(r['mfu_percent'], 100 * r['achieved_gflops_per_s'] / r['peak_gflops_per_s'],
                            rel_tol=1e-6)
        assert r['xla_flops_per_step'] > 0
    assert report['figures']['peak_gflops_per_s_float32'] == report['rows'][0]['peak_gflops_per_s']


def _check_compile(report):
    cases = [(r['program'], r['n_layer'], r['scan_layers'], r['collector']) for r in report['rows']]
    # Depth x scan, then the deepest loop again with Python's own collector settings; then the
    # deepest init, looped and scanned, with its draws' hashes shared and one per draw.
    inits = [(f'init, {d}', 2, s, 'memjax') for s in (False, True) for d in ('shared hashes', 'a hash per draw')]
    assert cases == ([('train step', n, s, 'memjax') for n in (1, 2) for s in (False, True)]
                     + [('train step', 2, False, 'python')] + inits)
    assert all(r['compile_s'] > 0 and r['lower_s'] > 0 for r in report['rows'])
    python, memjax = report['rows'][4], report['rows'][2]
    assert report['figures']['python_collector_over_memjax_lower'] == python['lower_s'] / memjax['lower_s']
    shared, per_draw = report['rows'][5], report['rows'][6]
    assert math.isclose(report['figures']['init_hash_per_draw_over_shared_loop'], per_draw['total_s'] / shared['total_s'])


def _check_programs(report):
    found = {(r['case'], r['step']): r['fingerprint'] for r in report['rows']}
    assert set(found) == {(c, s) for c in programs.CASES for s in ('train', 'eval')}
    # Evaluation switches Skip-Retain and cross-head attention off: the very program of plain XL.
    assert found[('xl_skip_cross_head', 'eval')] == found[('xl', 'eval')]
    trains = [found[(c, 'train')] for c in programs.CASES]
    assert len(set(trains)) == len(trains)


def test_program_fingerprints_ignore_source_locations_and_see_every_op():
    """The same computation written on other lines hashes alike; one more op does not."""
    x = jnp.ones((4, 4))
    first = jax.jit(lambda a: jnp.tanh(a @ a) + 1.0).lower(x).compile()

    second = jax.jit(  # Only the source locations differ: other lines, other columns.
        lambda a:
        jnp.tanh(a @ a) + 1.0).lower(x).compile()
    third = jax.jit(lambda a: jnp.tanh(a @ a) + 2.0).lower(x).compile()
    assert first.as_text() != second.as_text()
    assert hlo.program_text(first) == hlo.program_text(second)
    assert hlo.program_text(first) != hlo.program_text(third)


def _check_memory(report):
    cases = {(r['remat'], r['scan_layers']) for r in report['rows']}
    assert cases == {(p, s) for p in ('none', 'full', 'dots_saveable') for s in (False, True)}
    for r in report['rows']:
        b = r['bytes']
        assert r['peak_mib'] * 2 ** 20 == (b['argument_size_bytes'] + b['output_size_bytes']
                                            - b['alias_size_bytes'] + b['temp_size_bytes'])
        assert b['alias_size_bytes'] > 0  # Donated state is updated in place.


def _check_devices(report):
    one, eight = report['rows']
    assert (one['devices'], eight['devices']) == (1, 8)
    assert one['per_device_batch'] == one['global_batch']
    assert eight['per_device_batch'] * 8 == eight['global_batch']  # The batch really is split.
    assert math.isclose(report['figures']['throughput_8_over_1'], eight['tokens_per_s'] / one['tokens_per_s'])


def _check_adaptive_softmax(report):
    shares = [r['tail_share'] for r in report['rows']]
    assert shares == sorted(shares) and shares[0] == 0.0 and shares[-1] == 1.0
    first, last = report['rows'][0], report['rows'][-1]
    assert first['measured_tail_share'] == 0.0 and last['measured_tail_share'] == 1.0
    for r in report['rows']:
        assert math.isclose(r['time_vs_no_tail'], r['step_ms'] / first['step_ms'])
    model = report['config']['model']
    tokens = report['config']['batch'] * report['config']['tgt_len']
    assert math.isclose(first['full_tail_logits_mib'] * 2 ** 20,
                        tokens * (model['vocab_size'] - model['cutoffs'][0]) * 4)


def _check_skip(report):
    rows = [r for r in report['rows'] if r['row'] == 'k of N']
    assert [r['layers_skipped'] for r in rows] == [0, 1, 2] and rows[0]['time_vs_none_skipped'] == 1.0
    for r in rows:
        assert math.isclose(r['time_vs_none_skipped'], r['step_ms'] / rows[0]['step_ms'])
    phase = {r['step']: r for r in report['rows'] if r['row'] == 'phase 1'}
    assert list(phase) == ['xl', 'xl, conditional, none skipped', 'skip-retain, none skipped', 'skip-retain, eq. (1)',
                           'xl + cross-head, beta 0.1']
    for r in phase.values():
        assert math.isclose(r['time_vs_xl'], r['step_ms'] / phase['xl']['step_ms'])
    figures = report['figures']
    assert math.isclose(figures['phase1_mean_vs_xl_mean'],
                        phase['skip-retain, eq. (1)']['mean_step_ms'] / phase['xl']['mean_step_ms'])
    assert math.isclose(figures['cross_head_mean_vs_xl_mean'],
                        phase['xl + cross-head, beta 0.1']['mean_step_ms'] / phase['xl']['mean_step_ms'])
    n = phase['xl']['n_layer']  # Eq. (1): 1 - sum_{i<N} 0.5 (i - 1) / N / N.
    assert math.isclose(figures['expected_fraction_of_layers_run'], 1 - sum(0.5 * i / n for i in range(n - 1)) / n)


def _check_lamemo(report):
    rows = report['rows']
    assert [r['memory'] for r in rows] == ['xl', 'lamemo'] * 2
    for xl, lamemo in zip(rows[::2], rows[1::2]):
        assert xl['size'] == lamemo['size']
        # The same weights, and the look-ahead's global positional bias v-.
        extra = lamemo['model']['n_head'] * lamemo['model']['d_head']
        assert math.isclose((lamemo['params_M'] - xl['params_M']) * 1e6, extra, rel_tol=1e-6)
        assert math.isclose(lamemo['time_vs_xl'], lamemo['step_ms'] / xl['step_ms'])
        # The memory rows' extra matmuls, counted analytically (checked against XLA above).
        assert math.isclose(lamemo['flops_vs_xl'], lamemo['gflop_per_step'] / xl['gflop_per_step'])
        assert lamemo['flops_vs_xl'] > 1
        assert report['figures'][f"{xl['size']} time_vs_xl"] == lamemo['time_vs_xl']


def _check_infinity(report):
    rows = report['rows']
    contexts = [r['context'] for r in rows if r['row'] == 'context' and r['memory'] == 'infinity']
    assert contexts == sorted(contexts) and len(contexts) >= 2
    assert [r['mem_len'] for r in rows if r['row'] == 'context' and r['memory'] == 'xl'] == contexts
    none, ltm = (r for r in rows if r['row'] == 'overhead')
    assert (none['memory'], ltm['memory']) == ('none', 'infinity')
    for phase in ('train', 'eval'):
        assert math.isclose(report['figures'][f'ltm_{phase}_overhead'],
                            ltm[f'{phase}_ms_per_token'] / none[f'{phase}_ms_per_token'] - 1)
        assert math.isclose(ltm[f'{phase}_vs_base'], ltm[f'{phase}_ms_per_token'] / none[f'{phase}_ms_per_token'])


def _check_trams(report):
    rows = {r['evaluator']: r for r in report['rows']}
    cfg = report['config']
    equal, whole = rows[f"xl m={cfg['select']}"], rows[f"xl m={cfg['pool']}"]
    assert (equal['attended'], whole['attended']) == (cfg['select'], cfg['pool'])
    for r in rows.values():
        assert math.isclose(r['vs_xl_equal_attended'], r['step_ms'] / equal['step_ms'])
        assert math.isclose(r['vs_xl_whole_pool'], r['step_ms'] / whole['step_ms'])
        assert math.isclose(r['ms_per_token'], r['step_ms'] / (cfg['batch'] * cfg['tgt_len']))
    trams = [r for r in rows.values() if r['memory'] == 'trams']
    assert len(trams) == 2 and all((r['pool'], r['attended']) == (cfg['pool'], cfg['select']) for r in trams)


CHECKS = {'trams': _check_trams, 'infinity': _check_infinity, 'lamemo': _check_lamemo, 'skip': _check_skip, 'peak': _check_peak, 'adaptive-softmax': _check_adaptive_softmax, 'train': _check_train, 'compile': _check_compile,
          'memory': _check_memory, 'devices': _check_devices, 'programs': _check_programs}


@pytest.fixture(scope='module')
def command_line_reports(tmp_path_factory):
    """Every suite of CHECKS at --size=tiny from one command line (one process: JAX starts once)."""
    out = tmp_path_factory.mktemp('bench')
    (out / 'tmp').mkdir()  # Its temporary folder, which it must leave as it found it.
    proc = subprocess.run(
        [sys.executable, '-m', 'memjax.bench', *sorted(CHECKS), '--size=tiny', '--warmup=0', '--repeats=1',
         f'--out={out}/{{suite}}.json'], cwd=REPO, capture_output=True, text=True, check=False,
        env={**os.environ, 'TMPDIR': str(out / 'tmp')})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, out


def test_the_suites_leave_nothing_in_the_temporary_folder(command_line_reports):
    _, out = command_line_reports
    assert sorted(os.listdir(out / 'tmp')) == []


@pytest.mark.parametrize('suite', sorted(CHECKS))
def test_suite_runs_tiny_from_the_command_line(suite, command_line_reports):
    stdout, out = command_line_reports
    assert f'## {suite} (tiny)' in stdout
    out = out / f'{suite}.json'
    report = json.loads(out.read_text())
    assert report['suite'] == suite and report['size'] == 'tiny'
    machine = report['machine']
    assert machine['usable_cores'] >= 1 and machine['cpu_model']
    assert machine['versions']['jax'] and machine['versions']['jaxlib']
    assert machine['device_count'] >= 1 and machine['device_kind']
    assert report['config'] and report['figures'] and report['rows']
    for row in report['rows']:
        assert set(report['columns']) <= set(row)
    CHECKS[suite](report)


def test_reports_list_the_programs_their_suites_compiled(command_line_reports):
    """A report's `programs` are the fingerprints of what its suite compiled, in order: the same
    program compiled by another suite of the process has the same one, another program another."""
    _, out = command_line_reports
    found = {s: json.loads((out / f'{s}.json').read_text())['programs']
             for s in ('peak', 'train', 'lamemo', 'compile', 'devices')}
    peak = found['peak']
    assert len(peak) == 4 and len(set(peak)) == 4  # Two products, each in two dtypes.
    # The train and lamemo suites measure the same peak first (their MFU's denominator).
    assert found['train'][:4] == peak == found['lamemo'][:4]
    assert len(found['train']) == 4 + 3 and len(set(found['train'][4:])) == 3  # One step per model size.
    assert len(found['lamemo']) == 4 + 4 and len(set(found['lamemo'][4:])) == 4  # Two shapes x XL, LaMemo.
    # Depth x scan, once each; the deepest loop again (another collector setting, the same program);
    # four inits (looped, scanned; hashes shared or not), four programs.
    assert len(found['compile']) == 9 and len(set(found['compile'])) == 8 and found['compile'][4] == found['compile'][2]
    assert len(found['devices']) == 2 and len(set(found['devices'])) == 2  # 1 and 8 devices, from workers.


@pytest.mark.parametrize('cpuinfo,expected', [
    # A VM's generic names; the family and model say which core it is (AMD's and Intel's tables).
    ('processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\n'
     '\nprocessor\t: 1\nmodel name\t: other\n', 'AMD EPYC (family 25 model 17: Zen 4)'),
    ('vendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 1\nmodel name\t: AMD EPYC 7B13\n',
     'AMD EPYC 7B13 (family 25 model 1: Zen 3)'),
    ('vendor_id\t: AuthenticAMD\ncpu family\t: 23\nmodel\t\t: 49\nmodel name\t: AMD EPYC 7B12\n',
     'AMD EPYC 7B12 (family 23 model 49: Zen 2)'),
    ('vendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 143\nmodel name\t: Intel(R) Xeon(R) Platinum 8481C\n',
     'Intel(R) Xeon(R) Platinum 8481C (family 6 model 143: Sapphire Rapids)'),
    ('vendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 999\nmodel name\t: Intel Xeon Processor\n',
     'Intel Xeon Processor (family 6 model 999)'),  # Unknown to the table: the numbers alone.
    ('processor\t: 0\nmodel name\t: Neoverse\n', 'Neoverse'),  # No family: the name alone.
])
def test_cpu_model_names_the_microarchitecture_behind_a_generic_name(cpuinfo, expected):
    assert harness.cpu_model(cpuinfo) == expected


_PROFILE_SCAN = r'''
import json, os, re, sys
import jax, jax.numpy as jnp
from memjax.bench.suites import ops

def step(x, w):
    def body(carry, _):
        return jax.lax.cond(carry.sum() > -1e9, lambda c: jnp.tanh(c @ w), lambda c: c, carry), None
    return jax.lax.scan(body, x, None, length=5)[0]

x, w = jnp.ones((64, 128)) / 128, jnp.eye(128)
compiled = jax.jit(step).lower(x, w).compile()
hlo = compiled.as_text()
opcodes = {m.group(1): m.group(2) for m in re.finditer(r'%([\w.\-]+) = .*? ([a-z\-]+)\(', hlo)}
seconds, flops = ops.profile_xla(lambda: compiled(x, w), 3, hlo)
print(json.dumps({'opcodes': opcodes, 'ops': sorted(seconds), 'flops': sum(flops.values())}))
'''


def test_ops_profile_counts_loop_bodies_once():
    """A loop's and a conditional's profile events span their bodies' ops: only the body's ops are
    counted (each op's time once), and the product's FLOPs are the iterations' 5 x 2 x 64 x 128^2."""
    env = {**os.environ, 'XLA_FLAGS': '--xla_cpu_enable_xprof_traceme=true', 'JAX_PLATFORMS': 'cpu'}
    proc = subprocess.run([sys.executable, '-c', _PROFILE_SCAN], cwd=REPO, env=env, capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    profiled = {found['opcodes'].get(op, 'fusion') for op in found['ops']}
    assert 'while' in found['opcodes'].values() and 'conditional' in found['opcodes'].values()
    assert not profiled & {'while', 'conditional', 'call'}
    assert found['flops'] == pytest.approx(5 * 2 * 64 * 128 * 128)
