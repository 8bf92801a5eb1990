"""What the planner's test files share: paths, the shipped configs, the A100 preset, the CLI in-process."""
import os

from engine.flops import GPU_PRESETS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(os.path.join(ROOT, "configs", f) for f in os.listdir(os.path.join(ROOT, "configs"))
                 if f.endswith(".yaml"))
A100 = GPU_PRESETS["a100-80g"]
TOOL = os.path.join(ROOT, "tools", "find_parallelism.py")


def run_cli(*argv):
    """tools/find_parallelism.py's cli() in this process (tools/ is on sys.path in the tests)."""
    import find_parallelism
    return find_parallelism.cli(list(argv))
