"""One online-softmax step, shared by the attention kernels that read one loaded tile as both keys and values
(kernels/v4_attention.py's 512-wide latent, kernels/sparse_mla.py's selected latent rows).

Scores arrive raw, before the scale, and the softmax runs in base 2 (``scale_log2`` = scale * log2(e)): ``exp2``
is one instruction where ``exp`` is a multiply and an ``exp2``. A key that is not visible gets a score of -inf.
Layouts (``TOKEN_MAJOR``, as kernels/mla_attention.py's):
- head-major: ``s [heads, BLOCK_N]``, ``acc [heads, D]``;
- token-major: ``s [BLOCK_N, heads]``, ``acc [D, heads]``, which lets a program with few heads put the key rows
  on the MMA's M side;
and ``v [BLOCK_N, D]``, ``m_i`` and ``l_i [heads]`` in both. The reference is every kernel's own (the softmax of
all visible scores at once).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def online_softmax_step(s, visible, v, m_i, l_i, acc, scale_log2, TOKEN_MAJOR: tl.constexpr,
                        DOT_PRECISION: tl.constexpr):  # fmt: skip
    """(running max, running sum, accumulator) after one tile of scores ``s`` and values ``v``; ``visible``
    broadcasts against ``s``."""
    s = tl.where(visible, s * scale_log2, float("-inf"))
    if TOKEN_MAJOR:
        m_new = tl.maximum(m_i, tl.max(s, 0))
        # a row with nothing visible yet keeps -inf: exp2(-inf - 0) = 0, where -inf - -inf would be NaN
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[None, :])
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha[None, :] + tl.dot(tl.trans(v), p.to(v.dtype), input_precision=DOT_PRECISION)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc
