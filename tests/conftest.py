import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The tools are scripts, not an installed package: tests import them (and the benchmarks) by path.
sys.path[:0] = [ROOT, os.path.join(ROOT, "tools")]
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Subprocesses (torchrun jobs, the tools) import `engine` from this checkout too, not from wherever an editable
# install last pointed (another clone or worktree would otherwise be tested silently).
os.environ["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
