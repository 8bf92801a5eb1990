"""Pipeline parallelism: which layers each stage holds (`partition`), the schedules as per-rank orders
(`schedules`), the point-to-point plan (`p2p`), their execution (`runner`) and the trace (`trace`)."""
