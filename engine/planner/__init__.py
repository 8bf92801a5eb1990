"""The layout planner behind tools/find_parallelism.py: FLOPs and MFU (`flops`), parameters and memory per
GPU (`memory`), step time (`step_time`), the search over layouts (`search`), the published runs the step-time
model is checked against (`published`), and the check of the analytic counts against the model built on the
meta device (`verify`). The training loop does not import it."""
