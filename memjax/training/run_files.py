"""What a workdir holds besides its checkpoints' contents: the run's config, its results and
their history, where each lives."""

import json
import time
from typing import Any, Optional

from absl import logging
import jax

from memjax.runtime import storage

CONFIG_FILE = 'config.json'


def checkpoint_dir(workdir: str) -> str:
    return storage.join(workdir, 'checkpoints')


def write_json(path: str, payload: Any) -> None:
    """Process 0 replaces `path` (a file or gs:// object) whole."""
    if jax.process_index() == 0:
        storage.write_text(path, json.dumps(payload, indent=2, sort_keys=True))


HISTORY_FILE = 'results_history.jsonl'


def write_result(path: str, payload: dict, history: bool = True) -> None:
    """Writes `path`, the latest result of its kind (a run's summary, an evaluation), and appends it
    as one line to results_history.jsonl beside it (`history`): a rerun with other settings replaces
    the file, never the record of the results before it. A failed write loses nothing: the result
    goes to stdout and a kept copy (storage.write_result) before the one-line error."""
    if jax.process_index() != 0:
        return
    storage.write_result(path, json.dumps(payload, indent=2, sort_keys=True))
    if history:
        folder, name = path.rpartition('/')[0], path.rpartition('/')[2]
        record = storage.join(folder, HISTORY_FILE) if folder else HISTORY_FILE
        line = json.dumps({'file': name, 'written': time.strftime('%Y-%m-%d %H:%M:%S'), **payload}, sort_keys=True)
        try:
            storage.append_text(record, line + '\n')
        except (OSError, ValueError) as error:  # The result itself is written; its record is not worth a run.
            logging.warning('Could not add the result to %s (%s: %s).', record, type(error).__name__, error)


def read_json(path: str) -> Optional[Any]:
    """The JSON in `path`, or None when it is missing or unreadable."""
    text = storage.read_text(path)
    try:
        return None if text is None else json.loads(text)
    except ValueError:
        return None
