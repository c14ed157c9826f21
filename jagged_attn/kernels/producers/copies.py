"""What the backward reads of Q, K and V, and the per-token scales both sides form them on.

The backward's producers (``backward_passes``) and the forward's passes that write the backward's copies
ahead of it (``rebase``: ``keep_for``) store into the same containers (:class:`Quantized`) and round each
token over its own head_dim scale with the same two functions, so that a copy made by either is the copy
the other would have made.
"""

import torch
import triton
import triton.language as tl

from ..common import fp8
from ..common.layout import scale_byte_of_amax, scale_factor


@triton.jit
def token_scale_byte(x):
    """Per-row E8M0 byte of a ``[rows, D]`` tile: the head_dim-axis scale of each token."""
    return scale_byte_of_amax(tl.max(tl.abs(x), axis=1), False)


@triton.jit
def token_normalized_pairs(x, token_byte, INTERPRET: tl.constexpr):
    """The e4m3 values of the token-normalized transposed copies (Q's; K's on the exact-scores path, where K's
    feature copy casts these very values too, hence ``fp8.to_e4m3_paired_apart``): an fp32 ``[rows, D]`` tile,
    each token over its own head_dim scale (``token_byte`` ``[rows]``, :func:`token_scale_byte`). The forward's
    Q pass writes them as well (``keep_for`` of ``rebase.quantize_rebase_feature``); K's FP8 copies take the
    forward's operand form instead (``rebase.key_copies``)."""
    return fp8.to_e4m3_paired_apart(x * scale_factor(token_byte)[:, None], INTERPRET)


class Quantized:
    """What the producer wrote for one tensor (unrequested fields stay None): ``token_scale`` is each
    token's own head_dim scale (what a normalized sequence copy was divided by), ``feature_scale``
    itself unless tokens share one."""

    def __init__(self, feature=None, feature_scale=None, token_scale=None, sequence=None, sequence_scale=None):
        self.feature, self.feature_scale, self.token_scale = feature, feature_scale, token_scale
        self.sequence, self.sequence_scale = sequence, sequence_scale

    @classmethod
    def unwritten(cls, x, padded: int, *, feature_dtype=None, feature_group: int = 1, sequence_dtype=None):
        """Empty buffers for the copies of ``x [total, H, D]`` a producer writes: the feature copy in
        ``feature_dtype`` with its scales ``[H, total]`` and each token's own (the same tensor unless
        ``feature_group`` tokens share a scale), and the transposed copy ``[H, D, padded]`` in ``sequence_dtype``
        (None: no such copy); no sequence scales."""
        (total, heads, dim), device = x.shape, x.device
        copies = cls()
        if feature_dtype is not None:
            copies.feature = torch.empty(x.shape, dtype=feature_dtype, device=device)
            copies.feature_scale = torch.empty(heads, total, dtype=torch.float32, device=device)
            copies.token_scale = (copies.feature_scale if feature_group == 1 else
                                  torch.empty(heads, total, dtype=torch.float32, device=device))
        if sequence_dtype is not None:
            copies.sequence = torch.empty(heads, dim, padded, dtype=sequence_dtype, device=device)
        return copies
