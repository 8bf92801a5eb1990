"""Mixture of experts: the router, the experts as one grouped GEMM, token dispatch over the expert-parallel
group, the MoE block that replaces an MLP, and the per-step statistics and expert-bias updates."""
