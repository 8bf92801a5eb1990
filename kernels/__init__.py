"""Fused kernels behind one dispatch point.

The model calls only `kernels.dispatch`: Triton kernels on CUDA (`*_triton.py`, imported lazily, so
this package imports without triton), the PyTorch references in `reference.py` elsewhere. The
references are also the oracle `tests/test_kernels.py` checks every kernel against.
"""
