"""TLX kernels for Hopper (sm_90): import only when ``tlx.tlx_available()``."""
