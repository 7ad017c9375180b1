"""Device helpers shared by every grouped-GEMM kernel (portable Triton, TLX Hopper, TLX Blackwell)."""
