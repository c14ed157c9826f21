"""Plain Triton kernels that write the attention kernels' operands, on any CUDA GPU and in the CPU
interpreter: jagged quantization in one pass (``quantize``), fused RMSNorm + quantize
(``rmsnorm_quantize``), the projection GEMM with a quantizing epilogue (``linear_quantize``), K and V
centering (``center``), the forward's rebased operands (``rebase``) and the backward's per-slot passes
(``backward_passes``)."""
