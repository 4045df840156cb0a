"""Datasheet rates of the accelerators memjax trains on: the denominators of MFU against the chip.

The `peak` suite measures what a product reaches on the machine at hand; these are the vendor's
dense (no sparsity) matrix rates, the figure a reader compares across libraries and papers.
"float32" on a GPU is its TF32 rate because that is what JAX's default float32 product runs there
(a 1024^3 product's relative error is ~3e-4, not float32's ~3e-7); on a TPU it is the bf16 rate,
for the same reason.
"""

from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    bf16_tflops: float  # Dense bf16 matrix rate.
    float32_tflops: float  # What a default-precision float32 product runs at (TF32 on GPUs).
    hbm_tb_per_s: float

    def tflops(self, dtype: str) -> float:
        return self.bf16_tflops if dtype == 'bfloat16' else self.float32_tflops


# (substring of jax's device_kind, chip), most specific first: 'NVIDIA H100 80GB HBM3' is the SXM
# part, 'NVIDIA H100 PCIe' and 'NVIDIA H100 NVL' slower cards, 'NVIDIA GH200' the superchip's GPU.
_CHIPS = (
    ('GH200', Chip('NVIDIA GH200', 989.0, 494.0, 4.9)),
    ('H200', Chip('NVIDIA H200', 989.0, 494.0, 4.8)),
    ('H100 PCIe', Chip('NVIDIA H100 PCIe', 756.0, 378.0, 2.0)),
    ('H100 NVL', Chip('NVIDIA H100 NVL', 835.0, 418.0, 3.9)),
    ('H100', Chip('NVIDIA H100 SXM', 989.0, 494.0, 3.35)),
    ('A100', Chip('NVIDIA A100', 312.0, 156.0, 2.0)),
    ('TPU v6', Chip('TPU v6e (Trillium)', 918.0, 918.0, 1.64)),
    ('TPU v5p', Chip('TPU v5p', 459.0, 459.0, 2.76)),
    ('TPU v5 lite', Chip('TPU v5e', 197.0, 197.0, 0.82)),
    ('TPU v5e', Chip('TPU v5e', 197.0, 197.0, 0.82)),
    ('TPU v5', Chip('TPU v5p', 459.0, 459.0, 2.76)),  # JAX's device_kind of a v5p.
    ('TPU v4', Chip('TPU v4', 275.0, 275.0, 1.2)),
)


def datasheet(device_kind: str) -> Optional[Chip]:
    """The chip a jax `device_kind` names, or None (CPUs and chips not listed: no datasheet MFU)."""
    for key, chip in _CHIPS:
        if key.lower() in device_kind.lower():
            return chip
    return None
