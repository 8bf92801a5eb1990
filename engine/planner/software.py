"""The engine features a step's cost depends on beside the layout, as one value the time model reads."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from engine.optim.newton_schulz import MuonSettings
from engine.planner.params import GRAD_BYTES


@dataclass(frozen=True)
class Software:
    """Engine features that change the cost but not the layout.

    tp_comm_overlap: fraction of the tensor-parallel collectives hidden behind GEMMs (Megatron-Core's
    --tp-comm-overlap; this engine does not overlap them: 0). attention_efficiency: the flash-attention
    kernel's throughput as a fraction of peak when it differs from the GPU's default
    (layer_time.FLASH_ATTENTION_EFFICIENCY), e.g. an older kernel. document_length: samples packed with
    documents of this mean length under --reset-attention-mask, whose attention the kernels skip but for each
    document's own square (engine/attention_mask.py counts it; None: each sample one sequence). muon: the step
    is Muon's (engine/planner/muon_step.py prices its Newton-Schulz work and exchanges; its state is smaller). fp8:
    the FP8 recipe of the hidden linears (layer_time prices their GEMMs and the casts); fp8_format: e4m3 or
    hybrid (whether the experts' input gradient runs on FP8 tensor cores too). fp8_param_gather: the
    distributed optimizer gathers the FP8 linears' and routed experts' weights as FP8 codes
    (engine/planner/fp8_gather.py), where the engine takes the flag: see `gathers_fp8`. fp8_output_layer: the
    output layer's GEMMs in FP8 too (--fp8-output-layer), at the hidden linears' rate with their casts.
    """
    flash_attention: bool = True
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = False
    precision: str = "bf16"
    grad_reduce_bytes: int = GRAD_BYTES   # fp32 main gradients; fp16 runs of 2021 reduced 2-byte grads
    tp_comm_overlap: float = 0.0
    cp_comm_type: str = "p2p"             # p2p: K/V ring overlapped with attention; all_gather: gathered first
    attention_efficiency: Optional[float] = None
    document_length: Optional[int] = None
    muon: Optional[MuonSettings] = None   # --optimizer muon's settings (None: Adam)
    fp8: Optional[str] = None             # --fp8-recipe when --fp8-format is given (None: no FP8)
    fp8_format: str = "hybrid"            # --fp8-format (with fp8)
    fp8_param_gather: bool = False        # --fp8-param-gather
    fp8_output_layer: bool = False        # --fp8-output-layer

    def gathers_fp8(self, sharding) -> bool:
        """Whether the step's priced gathers move FP8 codes under `sharding` (a layout's): --fp8-param-gather
        with a tensor-scaled recipe under a sharded optimizer (ZeRO-1/2's step gather, ZeRO-3's unit gathers).
        Layouts the flag is refused in (a search meets them too) gather as without it."""
        return self.fp8_param_gather and self.fp8 in ("tensorwise", "delayed") and sharding.optimizer
