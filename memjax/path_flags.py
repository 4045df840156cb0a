"""absl flags whose values are paths (--workdir, --out, --prompt_file, ...).

A shell expands `~` only where it begins a word, so `--workdir=~/runs/x` reaches the command as
typed. Parsed here, a leading `~` means the user's home before any module sees the value: every
module then names one folder (its lock, its log and its checkpoints alike). `gs://` URLs stay as
given.
"""

import os
import sys
from typing import Any, Optional

from absl import flags

from memjax.runtime import storage


def expand(path: str) -> str:
    """`path` with a leading `~` expanded; a `gs://` URL as given."""
    return path if storage.is_remote(path) else os.path.expanduser(path)


class _Parser(flags.ArgumentParser):

    def parse(self, argument: str) -> str:
        return expand(argument)

    def flag_type(self) -> str:
        return 'string'


class _ListParser(flags.ListParser):

    def parse(self, argument: Any) -> list[str]:
        return [expand(value) for value in super().parse(argument)]


def define(name: str, default: Optional[str], help_text: str, **kwargs) -> flags.FlagHolder:
    """A string flag holding a path, defined by the calling module (absl tells flags apart by it)."""
    return flags.DEFINE(_Parser(), name, default, help_text, module_name=_caller(), **kwargs)


def define_list(name: str, default: Optional[list[str]], help_text: str, **kwargs) -> flags.FlagHolder:
    """A comma-separated list of paths, defined by the calling module."""
    return flags.DEFINE(_ListParser(), name, default, help_text, serializer=flags.CsvListSerializer(','),
                        module_name=_caller(), **kwargs)


def _caller() -> str:
    """The module that defines the flag, named as absl names it (a command run with `python -m` by
    its script path): its --help lists the flag as its own."""
    name = sys._getframe(2).f_globals['__name__']  # pylint: disable=protected-access
    return sys.argv[0] if name == '__main__' else name
