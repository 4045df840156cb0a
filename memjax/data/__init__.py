"""Data for memjax: embedded corpus, TFDS builders, tokenizers, LM streams.

Submodules are imported explicitly (e.g. `memjax.data.pipeline`) so that
importing the package stays cheap and TFDS is loaded only when needed.
"""
