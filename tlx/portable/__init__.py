"""Stock-Triton kernels: run on any GPU Triton supports (and under TRITON_INTERPRET=1)."""
