"""The links a layout's collectives run over, and the seconds a collective takes on them.

Each group's collectives run over NVLink when the group fits in a node, else over the network at the bandwidth
of the NICs its members in a node bring (rank order tp, cp, dp, pp: Megatron's). Collectives are rings: an
all-reduce moves 2(n-1)/n of the bytes; an all-to-all sends each peer its share, over NVLink to the members in
the node and through the GPU's own NIC to the rest.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from engine.flops import GPUSpec
from engine.layout import Layout

# NCCL bus bandwidth as a fraction of the link's (nccl-tests on DGX A100/H100: ~230 of 300 GB/s
# NVLink, ~ 20-22 of 25 GB/s per HDR NIC), and per-collective latency.
NVLINK_EFFICIENCY = 0.77
NETWORK_EFFICIENCY = 0.85
NVLINK_LATENCY_S = 15e-6
NETWORK_LATENCY_S = 30e-6


@dataclass
class Link:
    gbps: float
    efficiency: float
    latency: float

    def seconds(self, nbytes: float) -> float:
        return nbytes / (self.gbps / 8 * 1e9 * self.efficiency) + self.latency


def all_reduce(nbytes: float, n: int, link: Link) -> float:
    """Ring all-reduce (or reduce-scatter + all-gather) of nbytes over n ranks."""
    return 0.0 if n == 1 else 2 * (n - 1) / n * (link.seconds(nbytes) - link.latency) + 2 * link.latency


@dataclass
class Links:
    """The link each group's collectives run over (rank order tp, cp, dp, pp: Megatron's)."""
    tp: Link
    cp: Link
    dp: Link
    pp: Link
    edp: Optional[Link] = None     # the experts' replicas (dp/ep x cp ranks, stride tp·ep)
    ep_in_node: int = 1            # EP group members in one node (the all-to-all's NVLink share)
    network: Optional[Link] = None  # one GPU's NIC


def group_links(layout: Layout, gpu: GPUSpec, gpus_per_node: int, cp_collective: bool = False) -> Links:
    """A CP group is tp*cp consecutive ranks (stride tp), a dp x cp group tp*cp*dp; pipeline neighbours are
    tp*cp*dp ranks apart, so they share a node only when the whole job does. A ring collective whose group
    has k members in each node runs k rings side by side (NCCL channels), one per member's NIC, so across
    nodes it moves k x one NIC's bandwidth (capped by NVLink); a point-to-point ring step (the CP K/V
    exchange) crosses a node boundary through one NIC."""
    nvlink = Link(gpu.nvlink_gbps, NVLINK_EFFICIENCY, NVLINK_LATENCY_S)

    def group(span: int, stride: int, collective: bool) -> Link:
        if span <= gpus_per_node:
            return nvlink
        per_node = max(1, gpus_per_node // stride) if collective else 1
        return Link(min(gpu.nvlink_gbps, per_node * gpu.network_gbps), NETWORK_EFFICIENCY, NETWORK_LATENCY_S)

    tp, cp, ep = layout.tp, layout.cp, layout.ep
    ep_in_node = ep if tp * cp * ep <= gpus_per_node else max(1, gpus_per_node // (tp * cp))
    return Links(nvlink, group(tp * cp, tp, cp_collective), group(tp * cp * layout.dp, tp, True),
                 group(layout.num_gpus, tp * cp * layout.dp, False), group(tp * cp * layout.dp, tp * ep, True),
                 ep_in_node, Link(gpu.network_gbps, NETWORK_EFFICIENCY, NETWORK_LATENCY_S))


def all_to_all(nbytes: float, ep: int, links: Links) -> float:
    """An all-to-all over the EP group in which every rank holds nbytes, 1/ep of it for each member: the
    share for members in the node goes over NVLink while the rest leaves through the GPU's own NIC."""
    if ep == 1:
        return 0.0
    inside = nbytes * (links.ep_in_node - 1) / ep
    outside = nbytes * (ep - links.ep_in_node) / ep
    return max(links.tp.seconds(inside), links.network.seconds(outside) if outside else 0.0)
