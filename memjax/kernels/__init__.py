"""memjax's own kernels, for the products where the backend's lag (memjax/kernels/cpu.py)."""
