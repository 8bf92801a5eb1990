"""benchmarks/gpu/tuning.py, the launch-setting sweep a GPU lease runs, on the CPU: each of its variants under Triton's
interpreter (test_kernels sets it up), its timing stubbed, so a lease is never the first to find the sweep broken.
"""
import pytest
import torch

import test_kernels as tk  # first: on CPU it points Triton at its interpreter before any kernel is defined

CUDA, DEVICE, needs_triton = tk.CUDA, tk.DEVICE, tk.needs_triton


@needs_triton
@pytest.mark.slow  # ~6 s: every launch variant of the GPU sweep under the interpreter
@pytest.mark.skipif(CUDA, reason="the sweep's CPU stand-in; on a GPU gpu-check runs the sweep itself")
def test_the_gpu_launch_sweep_runs_every_variant():
    """benchmarks/gpu/tuning.py runs only on a GPU, so a lease would be the first to find it broken: here each of its
    variants runs at tiny sizes under the interpreter (timing stubbed), each gives its row, and the report renders
    them all."""
    from unittest import mock
    from benchmarks.gpu import report, tuning

    class Opts:
        dry_run, quick, cuda = True, False, False

        def pick(self, full, quick, dry):
            return dry

    class Record:
        def __init__(self):
            self.rows = []

        def has_time(self, what, need):
            return True

        def row(self, table, row, text=""):
            self.rows.append(row)

    record = Record()
    with mock.patch.object(tuning, "median_ms", lambda fn, reps, cuda: (fn(), 1.0)[1]), \
            mock.patch.object(torch, "bfloat16", torch.float32):  # the interpreter's arithmetic, in fp32
        assert tuning.fp8_codes(Opts(), record, DEVICE, 1)
        tuning.norms_and_rope(Opts(), record, DEVICE, 1)
    kernels = [r["kernel"] for r in record.rows]
    assert kernels.count("fp8 codes: cast") == kernels.count("fp8 codes: swiglu forward") == len(tuning.CODES_LAUNCHES)
    assert kernels.count("rms_norm") == len(tuning.NORM_LAUNCHES)
    assert kernels.count("add_rms_norm") + kernels.count("layer_norm") == len(tuning.NORM_OTHERS)
    assert kernels.count("rope") == len(tuning.ROPE_WARPS) + len(tuning.ROPE_ROWS) * len(tuning.ROPE_ROWS_WARPS)
    table = report.tuning({"sections": {"tuning": {"tables": {"tuning": record.rows}}}})
    assert len(table) == 2 + len(record.rows)
