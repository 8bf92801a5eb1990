"""Rotary position encoding's frequencies: plain, Llama 3.1's scaling, and YaRN (DeepSeek-V3's MLA).

`inverse_frequencies(cfg)` gives the d/2 inverse frequencies of the channels RoPE rotates (`cfg.rope_dim()`: the
whole head, or MLA's decoupled part); the model turns positions into angles with them, and the kernels rotate.
YaRN (Peng et al. 2023, as DeepSeek-V3, transformers' rope_type "yarn" and Megatron-Core's YarnRotaryEmbedding
define it) blends each frequency between itself (extrapolation) and itself over the factor (interpolation) by a
linear ramp over the channel range whose wavelength makes between beta_fast and beta_slow rotations in the
original context, and scales magnitudes: the rotated channels by `yarn_rope_scale` (transformers multiplies cos
and sin by it) and the softmax by `yarn_mscale(mscale_all_dim)` squared (`softmax_scale`).
"""
from __future__ import annotations

import math

import torch


def llama3_scaled(inv: torch.Tensor, cfg) -> torch.Tensor:
    """Llama 3.1's scaling of the RoPE inverse frequencies (HF rope_type "llama3", Megatron --use-rope-scaling).

    Wavelengths longer than original/low_freq_factor are stretched by the factor, those shorter than
    original/high_freq_factor kept, and those between blended linearly in original/wavelength.
    """
    factor, low, high = cfg.rope_scaling_factor, cfg.rope_scaling_low_freq_factor, cfg.rope_scaling_high_freq_factor
    original = cfg.rope_scaling_original_max_position_embeddings
    wavelen = 2 * math.pi / inv
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv / factor + smooth * inv
    return torch.where(wavelen > original / low, inv / factor, torch.where(wavelen < original / high, inv, blended))


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 without extension)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _correction_dim(rotations: float, d: int, base: float, original: int) -> float:
    """The channel index (of d) whose wavelength makes `rotations` turns in the original context."""
    return d * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_scaled(inv: torch.Tensor, cfg) -> torch.Tensor:
    d, base, factor = cfg.rope_dim(), cfg.rotary_base, cfg.rotary_scaling_factor
    original = cfg.original_max_position_embeddings
    low = max(math.floor(_correction_dim(cfg.beta_fast, d, base, original)), 0)
    high = min(math.ceil(_correction_dim(cfg.beta_slow, d, base, original)), d - 1)
    high = high + 0.001 if low == high else high  # a ramp of one point
    ramp = ((torch.arange(d // 2, dtype=torch.float32, device=inv.device) - low) / (high - low)).clamp(0, 1)
    return inv / factor * ramp + inv * (1 - ramp)


def inverse_frequencies(cfg, device=None) -> torch.Tensor:
    """[rope_dim/2] fp32 inverse frequencies of ModelConfig `cfg`."""
    d = cfg.rope_dim()
    inv = 1.0 / (cfg.rotary_base ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
    if cfg.yarn():
        return yarn_scaled(inv, cfg)
    return llama3_scaled(inv, cfg) if cfg.use_rope_scaling else inv


def yarn_rope_scale(cfg) -> float:
    """What the rotated channels are multiplied by (1 without YaRN)."""
    if not cfg.yarn():
        return 1.0
    factor = cfg.rotary_scaling_factor
    if cfg.mscale and cfg.mscale_all_dim:
        return yarn_mscale(factor, cfg.mscale) / yarn_mscale(factor, cfg.mscale_all_dim)
    return yarn_mscale(factor)


def softmax_scale(cfg, qk_dim: int) -> float:
    """The attention logits' scale: 1/sqrt(q/k channels), times YaRN's mscale(mscale_all_dim) squared."""
    scale = qk_dim ** -0.5
    if cfg.yarn() and cfg.mscale_all_dim:
        scale *= yarn_mscale(cfg.rotary_scaling_factor, cfg.mscale_all_dim) ** 2
    return scale
