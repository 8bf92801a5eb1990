"""Run control: what keeps a training job safe to stop, restart and diagnose, beside the loop itself.

Stop signals, the time limit and the orphan watch (`preemption`); every rank's heartbeat, to name the rank
that stopped (`liveness`); the name of the work in progress (`phase`); the profiler window (`profiling`);
one writer per `--save` (`lock`); the device and backend a rank runs on (`device`); and how the launcher ends
a failed rank and gives back what it holds (`guard`). Import the modules directly.
"""
