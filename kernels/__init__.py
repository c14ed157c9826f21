"""GPU kernels (Triton), imported as ``jagged_attn.kernels``; one module per kernel family."""
