"""TLX kernels for Blackwell (sm_100): import only when ``tlx.tlx_available()``."""
