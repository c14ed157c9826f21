"""Blackwell (sm_100+) attention, backend ``block-scaled``: the spec-exact ``tl.dot_scaled`` kernels
(``block_scaled``), native block-scaled MMA on sm_100, emulated by Triton on sm_90."""
