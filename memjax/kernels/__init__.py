"""memjax's own kernels, for the products a backend runs well below its peak (memjax/kernels/cpu.py)."""
