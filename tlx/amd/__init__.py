"""TLX kernels for AMD CDNA3 / CDNA4 (gfx942 MI300X, gfx950 MI350): import only when ``tlx.tlx_available()``."""
