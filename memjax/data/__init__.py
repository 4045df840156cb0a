"""Data for memjax, in the order it flows:

  config.py           DataConfig: config.data's fields and their defaults
  builders.py         TFDS builders: raw files -> prepared records -> documents
                      (embedded_corpus.py: the corpus shipped with memjax)
  tokenizers.py       text <-> token ids
  streams.py          BatchedStreams: the batches a run reads, resumable by index
  pipeline.py         LMStreams: a split's cached token ids as parallel streams of segments
  sorting.py          the generated sorting task: its tokenizer and streams
  factory.py          the tokenizer and the streams a DataConfig names

Submodules are imported explicitly (e.g. `memjax.data.pipeline`) so that
importing the package stays cheap and TFDS is loaded only when needed.
"""
