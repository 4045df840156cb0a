"""Data for memjax, in the order it flows:

  config.py           DataConfig: config.data's fields and their defaults
  builders.py         TFDS builders: raw files -> records, the builder a DataConfig names
                      (embedded_corpus.py: the corpus shipped with memjax)
  prepared.py         a dataset prepared once in data.data_dir, its splits read back as documents
  tokenizers.py       text <-> token ids
  streams.py          BatchedStreams: the batches a run reads, resumable by index
  pipeline.py         LMStreams: a split's cached token ids as parallel streams of segments
  sorting.py          the generated sorting task: its tokenizer and streams
  factory.py          the tokenizer and the streams a DataConfig names

Submodules are imported explicitly (e.g. `memjax.data.pipeline`) so that
importing the package stays cheap and TFDS is loaded only when needed.
"""
