"""Reading XLA's optimized HLO text: the FLOPs of each op's matrix products, memjax's CPU kernels
included (which XLA's cost analysis does not see), which ops are control flow, and a program's
fingerprint."""

from __future__ import annotations

import collections
import hashlib
import math
import re
from typing import Optional

from memjax.kernels import cpu as cpu_kernels

INSTRUCTION = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+) = (\([^)]*\)|\S+?)(?:\{[^}]*\})? (\w[\w\-]*)\((.*)$')
_COMPUTATION = re.compile(r'^\s*(?:ENTRY\s+)?%?([\w.\-]+) \(.*\{\s*$')
_SHAPE = re.compile(r'\w+\[([\d,]*)\]')
_LOCATION_LINE = re.compile(r'^\d+ (\{file_name_id=|\{file_location_id=|")')
_METADATA = re.compile(r',? ?(metadata=\{[^}]*\}|stack_frame_id=\d+)')


def program_text(compiled) -> str:
    """A compiled program's (`jax.stages.Compiled`) optimized HLO without anything that names a
    source location: they move with every edited line, the program does not."""
    lines = (compiled.as_text() or '').splitlines()  # None where a backend has no text form.
    return '\n'.join(_METADATA.sub('', line) for line in lines if not _LOCATION_LINE.match(line))


def fingerprint(text: str) -> str:
    """16 hex digits of `program_text`'s SHA-256: equal on one machine and jax version for the same
    program."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _dims(shape: str) -> list[int]:
    found = _SHAPE.search(shape)
    return [int(d) for d in found.group(1).split(',') if d] if found else []


def _dot_flops(output: str, lhs: str, rest: str) -> float:
    """2 x output elements x contracted size of one `dot` whose left operand has shape `lhs`."""
    contracting = re.search(r'lhs_contracting_dims=\{([\d,]*)\}', rest)
    if contracting is None:
        return 0.0
    lhs_dims = _dims(lhs)
    size = math.prod(lhs_dims[int(i)] for i in contracting.group(1).split(',') if i)
    return 2.0 * math.prod(_dims(output)) * size


def _operand_dims(rest: str, count: int) -> list[list[int]]:
    """The dimensions of a custom call's first `count` operands, from its layout constraints."""
    constraints = re.search(r'operand_layout_constraints=\{(.*)', rest).group(1)
    return [_dims(shape) for shape in re.findall(r'\w+\[[\d,]*\]', constraints)[:count]]


def op_flops(hlo: str) -> dict[str, float]:
    """{op name of the optimized HLO: FLOPs of the matrix products it runs}; a fusion counts the dots
    of the computations it calls, and memjax's own CPU kernel counts its product."""
    shapes: dict[str, str] = {}
    dots: dict[str, tuple[str, str, str]] = {}
    kernels: dict[str, float] = {}
    calls: dict[str, list[str]] = {}
    members: dict[str, list[str]] = collections.defaultdict(list)
    computation = None
    for line in hlo.splitlines():
        instruction = INSTRUCTION.match(line)
        if instruction is None:
            header = _COMPUTATION.match(line)
            if header is not None:
                computation = header.group(1)
            continue
        name, output, opcode, rest = instruction.groups()
        shapes[name] = output
        if opcode == 'dot':
            dots[name] = (output, re.match(r'\s*%?([\w.\-]+)', rest).group(1), rest)
        if opcode == 'custom-call' and f'custom_call_target="{cpu_kernels.TARGET}"' in rest:
            # memjax's batched product (memjax/kernels/cpu.py): lhs [..., M, K] (or [..., K, M] read
            # transposed) @ rhs [..., K, N].
            contracted = _operand_dims(rest, 1)[0][-2 if re.search(r'transpose_lhs = true', rest) else -1]
            kernels[name] = 2.0 * math.prod(_dims(output)) * contracted
        if opcode == 'custom-call' and f'custom_call_target="{cpu_kernels.SOFTMAX_TARGET}"' in rest:
            # memjax's span softmax: a content and a positional product per score (the first output),
            # over the queries' last axis (queries [B, T, H, D] first).
            kernels[name] = 2 * 2.0 * math.prod(_dims(output)) * _operand_dims(rest, 1)[0][-1]
        if opcode == 'custom-call' and f'custom_call_target="{cpu_kernels.SOFTMAX_GRADIENT_TARGET}"' in rest:
            # Its gradient: four products per score (probabilities [B, H, T, K] first), over the
            # queries' last axis (the query gradient [B, T, H, D] is the first output).
            kernels[name] = 4 * 2.0 * math.prod(_operand_dims(rest, 1)[0]) * _dims(output)[-1]
        attend = re.search(f'custom_call_target="({cpu_kernels.ATTEND_TARGET}|{cpu_kernels.ATTEND_GRADIENT_TARGET})"',
                           rest)
        if opcode == 'custom-call' and attend is not None:
            # The weighted values (weights [B, H, T, K], values [B, K, H, D] first): one product per
            # weight and value dimension; the gradient two.
            weights, values = _operand_dims(rest, 2)
            products = 2 if attend.group(1) == cpu_kernels.ATTEND_GRADIENT_TARGET else 1
            kernels[name] = products * 2.0 * math.prod(weights) * values[-1]
        if opcode == 'custom-call' and f'custom_call_target="{cpu_kernels.SPAN_ATTENTION_TARGET}"' in rest:
            # Evaluation's one pass (queries [B, T, H, D], then the memory's keys [B, M, H, D]): the
            # content, positional and weighted-value products per score over K = M + T keys.
            query, memory = _operand_dims(rest, 2)
            kernels[name] = 3 * 2.0 * math.prod(query) * (memory[1] + query[1])
        cluster = re.search(f'custom_call_target="({cpu_kernels.CLUSTER_TARGET}|{cpu_kernels.CLUSTER_GRADIENT_TARGET})"',
                            rest)
        if opcode == 'custom-call' and cluster is not None:
            # A cluster's logits (rows [N, D], table [V, D] first), as if every row were selected:
            # an upper bound for a tail cluster, which scores only its targets' rows. The gradient
            # computes them again and two products more.
            rows, table = _operand_dims(rest, 2)
            products = 3 if cluster.group(1) == cpu_kernels.CLUSTER_GRADIENT_TARGET else 1
            kernels[name] = products * 2.0 * rows[0] * table[0] * rows[1]
        # Fusions only: the ops of a loop's body are profiled as ops of their own.
        calls[name] = re.findall(r'calls=%?([\w.\-]+)', rest)
        if computation is not None:
            members[computation].append(name)

    def total(name: str, seen: frozenset = frozenset()) -> float:
        flops = kernels.get(name, 0.0)
        if name in dots:
            output, lhs, rest = dots[name]
            flops = _dot_flops(output, shapes.get(lhs, ''), rest)
        for called in calls.get(name, ()):
            if called not in seen:
                flops += sum(total(member, seen | {called}) for member in members.get(called, ()))
        return flops

    return {name: total(name) for name in shapes}


def op_names(hlo: str) -> dict[str, Optional[str]]:
    """{op name of the optimized HLO: the `op_name` of its metadata, the JAX code it computes (None
    for an op XLA made itself: a layout copy, a conversion)}."""
    names = {}
    for line in hlo.splitlines():
        instruction = INSTRUCTION.match(line)
        if instruction is not None:
            found = re.search(r'op_name="([^"]*)"', line)
            names[instruction.group(1)] = found.group(1) if found else None
    return names


def matmul_ops(hlo: str) -> frozenset[str]:
    """Names of the optimized HLO's ops that multiply matrices, however they were lowered: dots and
    fusions of them (`op_flops`), convolutions (a TPU's products), cuBLAS calls (a GPU's)."""
    flops = op_flops(hlo)
    found = (INSTRUCTION.match(line) for line in hlo.splitlines())
    return frozenset(m.group(1) for m in found if m is not None and (
        flops.get(m.group(1), 0.0) > 0 or m.group(3) == 'convolution'
        or (m.group(3) == 'custom-call' and re.search(r'custom_call_target="__cublas', m.group(4)))))


def control_flow_ops(hlo: str) -> frozenset[str]:
    """Names of the optimized HLO's loops, conditionals and calls: each one's profile event spans the
    ops of the computations it runs, which have events of their own."""
    found = (INSTRUCTION.match(line) for line in hlo.splitlines())
    return frozenset(m.group(1) for m in found if m is not None and m.group(3) in ('while', 'conditional', 'call'))


def kernel_flops(hlo: str) -> float:
    """FLOPs of one run of the program's calls to memjax's CPU kernels (custom calls, which XLA's
    cost analysis counts as none)."""
    flops = op_flops(hlo)
    found = (INSTRUCTION.match(line) for line in hlo.splitlines())
    return sum(flops[m.group(1)] for m in found
               if m is not None and m.group(3) == 'custom-call' and 'custom_call_target="memjax_' in m.group(4))
