"""The layout planner behind tools/find_parallelism.py: parameters per rank from one inventory (`params`), the
stage map (`stages`), activations (`activations`) and memory per GPU (`memory`, with the sharding strategies'
exact bytes in `sharding`), step time (`step_time`, from a per-layer cost model in `layer_time` and the links in
`links`), the search over layouts (`search`), the published runs the step-time model is checked against
(`published`), and the check of the analytic counts against the model built on the meta device (`verify`).
It reads the engine's own Layout (engine.layout) and FLOPs count (engine.flops); the training loop never
reaches it."""
