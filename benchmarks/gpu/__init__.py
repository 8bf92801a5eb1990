"""The sections of benchmarks/gpu_check.py, one module each, and the runner that isolates them.

card (the roofs), correctness, kernels, training, memory; goals and report turn their figures into the goals
table and the Markdown. Every section is a function `run(opts, record, earlier)` run in its own forked process
(runner.py), so a CUDA error, a hang or an exception in one cannot take the others' figures with it.
"""
