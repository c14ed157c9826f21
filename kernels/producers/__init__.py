"""Plain Triton kernels that write the attention's MXFP8 operands, on any CUDA GPU and in the CPU
interpreter: jagged quantization in one pass (``quantize``), fused RMSNorm + quantize
(``rmsnorm_quantize``) and the projection GEMM with a quantizing epilogue (``linear_quantize``)."""
