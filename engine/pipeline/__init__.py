"""Pipeline parallelism: this rank's model chunks (`partition`), the schedules as per-rank orders (`schedules`,
`zero_bubble`, replayed at given costs by `replay`), the point-to-point plan (`p2p`), their execution with the
microbatch cut at the door (`runner`) and the trace (`trace`). Where stages sit is the layout's (engine.layout)."""
