"""Rotary position embeddings, numerically as transformers computes them (default, linear,
Llama 3 and YaRN inverse frequencies; rotate-half on the leading `rotary_dim` channels of each head)."""

from __future__ import annotations

import math

import torch

from swaserve.worker.models.config import RopeConfig


def inverse_frequencies(rope: RopeConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim / 2] float32 on CPU, attention scaling of cos/sin), as
    transformers' ROPE_INIT_FUNCTIONS compute them. Always on CPU, even under a meta device."""
    if rope.rope_type == "proportional":
        return _proportional(rope), 1.0
    dim = rope.freq_dim
    exponents = torch.arange(0, dim, 2, device="cpu").to(torch.float32) / dim  # [R/2] float32
    pos_freqs = rope.theta**exponents  # [R/2] float32
    if rope.rope_type == "default":
        return 1.0 / pos_freqs, 1.0
    if rope.rope_type == "linear":
        return 1.0 / pos_freqs / rope.factor, 1.0
    if rope.rope_type == "llama3":
        return _llama3(rope, 1.0 / pos_freqs), 1.0
    return _yarn(rope, pos_freqs)


def _proportional(rope: RopeConfig) -> torch.Tensor:
    """Gemma 4's proportional RoPE (transformers' `_compute_proportional_rope_parameters`):
    head_dim / 2 frequencies, the first `int(p · head_dim // 2)` over the whole head_dim, the
    rest 0 (those pairs do not rotate), all divided by `factor`."""
    d = rope.head_dim
    angles = int(rope.partial_rotary_factor * d // 2)
    exponents = torch.arange(0, 2 * angles, 2, device="cpu").to(torch.float32) / d
    rotated = 1.0 / rope.theta**exponents  # [angles] float32
    zeros = torch.zeros(d // 2 - angles, dtype=torch.float32, device="cpu")
    return torch.cat((rotated, zeros)) / rope.factor


def _llama3(rope: RopeConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    """Llama 3's scaling (transformers' `_compute_llama3_parameters`): low frequencies divided
    by `factor`, high ones kept, the band between interpolated smoothly."""
    factor, context = rope.factor, rope.original_max_position_embeddings
    low_wavelen = context / rope.low_freq_factor
    high_wavelen = context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq  # [R/2] float32
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(rope: RopeConfig, pos_freqs: torch.Tensor) -> tuple[torch.Tensor, float]:
    """YaRN (transformers' `_compute_yarn_parameters`): interpolate the low frequencies by
    `factor`, keep the high ones, blend linearly in between; scale cos/sin by the mscale."""
    dim, base, factor = rope.freq_dim, rope.theta, rope.factor

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = get_mscale(factor, rope.mscale) / get_mscale(
                factor, rope.mscale_all_dim
            )
        else:
            attention_factor = get_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        original = rope.original_max_position_embeddings
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as HF: avoid a zero-width ramp
    ramp = torch.arange(dim // 2, dtype=torch.float32, device="cpu")  # [R/2] float32
    ramp = torch.clamp((ramp - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_factor) + (
        1.0 / pos_freqs
    ) * extrapolation_factor  # [R/2] float32
    return inv_freq, float(attention_factor)


class RotaryEmbedding:
    """cos/sin tables of one layer kind at the batch's absolute positions. Holds no parameters,
    so it survives building on the meta device; the inverse frequencies move to each device once."""

    def __init__(self, rope: RopeConfig) -> None:
        self.rope = rope
        self._inv_freq_cpu, self.attention_scaling = inverse_frequencies(rope)
        self._inv_freq_by_device: dict[torch.device, torch.Tensor] = {}

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [T, rotary_dim / 2] in `dtype` (float32 for a `float32` rope) for
        positions [T] int64."""
        if self.rope.float32:
            dtype = torch.float32
        inv_freq = self._inv_freq_by_device.get(positions.device)
        if inv_freq is None:
            inv_freq = self._inv_freq_cpu.to(positions.device)
            if not torch.compiler.is_compiling():  # a traced step keeps no state of its own
                self._inv_freq_by_device[positions.device] = inv_freq
        freqs = positions[:, None].float() * inv_freq[None, :]  # [T, R/2] float32
        cos = (freqs.cos() * self.attention_scaling).to(dtype)  # [T, R/2]
        sin = (freqs.sin() * self.attention_scaling).to(dtype)  # [T, R/2]
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the leading 2·R/2 channels of x [T, heads, D] rotate-half style; the rest pass.
    In cos / sin's precision when it is higher than x's (float32 tables), cast back to x's."""
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    c, s = cos[:, None, :], sin[:, None, :]  # [T, 1, R/2]
    rotated = (x1 * c - x2 * s).to(x.dtype), (x2 * c + x1 * s).to(x.dtype)
    return torch.cat((*rotated, rest), dim=-1)  # [T, heads, D]


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (2i, 2i + 1) of x [T, heads, D] by frequency i (Cohere's RoPE),
    in float32 (cos / sin as given, upcast), then back to x's dtype."""
    xf = x.float()
    x1, x2 = xf[..., 0::2], xf[..., 1::2]  # [T, heads, D/2]
    c, s = cos.float()[:, None, :], sin.float()[:, None, :]  # [T, 1, D/2]
    return torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2).to(x.dtype)
