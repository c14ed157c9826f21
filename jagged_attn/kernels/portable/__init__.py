"""Attention in plain Triton, backend ``portable``: the same algorithm and operands as the Hopper kernels
(MX scales rebased out of the MMAs), as one program per tile with no warp specialization: the forward
(``forward``) and the backward (``backward``, with the deterministic dQ kernel the Hopper backward also
uses). It runs in the CPU interpreter (CI) and on any CUDA GPU with e4m3 MMAs (sm_89 and newer)."""

HEAD_DIMS = (64, 128)  # what both kernels are tuned and tested for
