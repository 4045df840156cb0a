"""The interface of every kind of batches a run reads (a corpus's LMStreams, generated tasks)."""

import abc
from typing import Dict, Optional

import grain
import numpy as np


class BatchedStreams(abc.ABC):
    """A pass of `num_batches` batches (`batch(index)`), repeated forever with `repeat`, read with
    grain: next() gives batches; get_state()/set_state() resume exactly."""

    num_batches: int
    repeat: bool
    # What the streams read, for a resumed run to notice other data (None: generated from the
    # config alone): {'source': the prepared dataset, 'tokens': a hash of the token ids}.
    fingerprint: Optional[Dict[str, str]] = None

    @abc.abstractmethod
    def batch(self, index: int) -> Dict[str, np.ndarray]:
        """Batch `index` (0 <= index < num_batches) of a pass."""

    def dataset(self) -> grain.MapDataset:
        ds = grain.MapDataset.range(self.num_batches)
        if self.repeat:
            ds = ds.repeat(None)
        return ds.map(self.batch)

    def iterator(self) -> grain.DatasetIterator:
        options = grain.ReadOptions(num_threads=1, prefetch_buffer_size=2)
        return iter(self.dataset().to_iter_dataset(options))
