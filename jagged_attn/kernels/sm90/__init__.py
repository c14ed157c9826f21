"""Hopper (sm_90) attention in Gluon, warp-specialized, every GEMM an FP8 (or, for the exact S and dP
of ``hopper-exact-scores``, bf16) wgmma: the forward (``forward``) and the backward (``backward``),
on the operands the rebasing producers make (``producers.rebase``, ``producers.backward_passes``)."""

HEAD_DIMS = (64, 128)  # what both kernels have tile configurations for
