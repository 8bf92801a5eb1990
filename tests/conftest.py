import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The tools are scripts, not an installed package: tests import them (and the benchmarks) by path.
sys.path[:0] = [ROOT, os.path.join(ROOT, "tools")]
os.environ.setdefault("OMP_NUM_THREADS", "1")
