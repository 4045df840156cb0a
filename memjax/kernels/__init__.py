"""memjax's own kernels and gradients: the products a backend runs well below its peak
(memjax/kernels/cpu.py) and the attention's softmax whose backward keeps only its compute-dtype
weights (memjax/kernels/softmax.py)."""
