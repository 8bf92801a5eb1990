"""The layout planner behind tools/find_parallelism.py: FLOPs and MFU (`flops`), parameters and memory per
GPU (`memory`), step time and the search over layouts (`step_time`), and the check of the analytic counts
against the model built on the meta device (`verify`). The training loop does not import it."""
