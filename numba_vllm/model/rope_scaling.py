"""RoPE frequencies, computed once on the host (float64, stored float32).

Rotary position embedding rotates each pair of a head's channels by `position * inv_freq[i]`. This
module is the one place that turns a config's `rope_theta` and `rope_scaling` into `inv_freq`; the
NumPy reference and the RoPE kernel both take its output. Channel pairing follows Hugging Face's
Llama ("rotate half"): channel i pairs with channel i + head_dim / 2.
"""

from __future__ import annotations

import numpy as np

from numba_vllm.model.config import ModelConfig, RopeScaling


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """Inverse frequencies, (head_dim // 2,) float32, with Llama-3 scaling applied if configured."""
    half = config.head_dim // 2
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(half, dtype=np.float64) * 2.0 / config.head_dim))
    if config.rope_scaling is not None:
        inv_freq = _llama3_scale(inv_freq, config.rope_scaling)
    return inv_freq.astype(np.float32)


def _llama3_scale(inv_freq: np.ndarray, s: RopeScaling) -> np.ndarray:
    """Llama 3.1's frequency scaling: keep high frequencies, divide low ones by `factor`, blend between."""
    wavelen = 2.0 * np.pi / inv_freq
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1.0 - smooth) * inv_freq / s.factor + smooth * inv_freq
    out = np.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    medium = (wavelen <= low_freq_wavelen) & (wavelen >= high_freq_wavelen)
    return np.where(medium, blended, out)


def rope_cos_sin(inv_freq: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of every (position, pair) angle: two (len(positions), head_dim // 2) float32 arrays."""
    angles = positions.astype(np.float64)[:, None] * inv_freq.astype(np.float64)[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
