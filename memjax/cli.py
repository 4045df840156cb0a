"""What every memjax command line does around its job.

A user error (`memjax.errors.UserError`, a bad flag, a config file that does not load)
ends the command with one line on stderr and the error's exit status; `--verbose` adds
the traceback. Anything else is a bug and keeps its traceback.
"""

import os
import re
import sys
import traceback
from typing import Any, Callable, NoReturn, Optional, Sequence

from absl import app
from absl import flags
import jax
import ml_collections
from ml_collections import config_flags

from memjax import config_lib
from memjax.runtime import collector
from memjax.runtime import distributed
from memjax import errors
from memjax.runtime import host_memory
from memjax.runtime import logs
from memjax.runtime import peer_watch
from memjax.training import workdir as workdir_lib
from memjax import path_flags

_HOST_MEMORY = flags.DEFINE_enum(
    'host_memory', 'auto', host_memory.MODES,
    'How XLA:CPU step buffers avoid being page-faulted in 4 KiB at a time every step (see '
    'memjax/runtime/host_memory.py): on = transparent huge pages (a glibc tunable, set by re-executing the '
    'command once), auto = on when JAX runs on the CPU, reuse = one malloc heap that keeps them '
    'mapped (fastest for large steps, slower for small fast ones), off = glibc defaults.')
_VERBOSE = flags.DEFINE_boolean(
    'verbose', False, 'On an error, print the Python traceback after the one-line message.')


def _exit_now(exit_code: int) -> NoReturn:
    """Tells the other processes of a multi-process run that this one ends, then exits at once."""
    peer_watch.ended(exit_code)
    errors.exit_now(exit_code)


def fail(error: BaseException, label: str, exit_code: int) -> NoReturn:
    """Prints `label: error` as one line (plus the traceback under --verbose) and exits."""
    # While the flags are parsed (a config file that does not load) --verbose is only in argv.
    if (_VERBOSE.value if flags.FLAGS.is_parsed() else '--verbose' in sys.argv):
        traceback.print_exception(error, file=sys.stderr)
    message = ' '.join(str(error).split())  # Library messages may span lines.
    print(f'{label}: {message}{logs.where_details_are()}', file=sys.stderr)
    _exit_now(exit_code)


def _parse_flags(argv: Sequence[str]) -> list[str]:
    try:
        return flags.FLAGS(argv)
    except errors.UserError as error:  # The workdir's own config (memjax/workdir_config.py).
        fail(error, error.label, error.exit_code)
    except flags.Error as error:
        if 'Error whilst parsing config file' in str(error):  # get_config() raised: its own words.
            config_error = _config_error(OSError(str(error).strip()), argv)
            fail(config_error, config_error.label, config_error.exit_code)
        fail(errors.UsageError(f'{error}{_config_field_hint(str(error))}'), errors.UsageError.label,
             errors.UsageError.exit_code)
    except (OSError, KeyError, AttributeError) as error:  # Raised by --config.a.b=v overrides.
        config_error = _config_error(error, argv)
        config_error.__cause__ = error  # --verbose prints where it was raised.
        fail(config_error, config_error.label, config_error.exit_code)
    except Exception as error:  # pylint: disable=broad-except  (the config file's own code failed)
        config_error = _config_error(OSError(f'{type(error).__name__}: {error}'), argv)
        config_error.__cause__ = error  # --verbose prints the file's own traceback.
        fail(config_error, config_error.label, config_error.exit_code)


# The config file whose get_config(workdir) is a trained workdir's own config.
WORKDIR_CONFIG_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'workdir_config.py')


def define_workdir_flags() -> tuple[flags.FlagHolder, flags.FlagHolder]:
    """--config and --workdir of a command that reads a trained workdir (evaluate, generate, sweep):
    --config defaults to the config the workdir's run was trained with; `--config.a.b=v` overrides
    apply on top of either."""
    config = config_flags.DEFINE_config_file(
        'config', None, 'Path to a configs/*.py file; default: the config the workdir\'s run was trained with '
        '(its config.json), to which --config.a.b=v overrides apply as well.', lock_config=True)
    workdir = path_flags.define('workdir', None, 'Training workdir holding checkpoints/.')
    flags.mark_flag_as_required('workdir')
    return config, workdir


def with_workdir_config(argv: Sequence[str]) -> list[str]:
    """`argv` with `--config=<WORKDIR_CONFIG_FILE>:<workdir>` first when it names a workdir and no
    --config (first: config overrides must follow the file they override). A workdir that does
    not exist is refused here, one without a readable config.json as that file loads; each in one
    line."""
    argv = list(argv)
    if any(re.match(r'--?config(=|$)', arg) for arg in argv[1:]):
        return argv
    workdir = None
    for i, arg in enumerate(argv[1:], 1):
        if re.match(r'--?workdir=', arg):
            workdir = arg.split('=', 1)[1]
        elif re.fullmatch(r'--?workdir', arg) and i + 1 < len(argv):
            workdir = argv[i + 1]
    if workdir is None:
        return argv  # absl says that --workdir is required.
    workdir = path_flags.expand(workdir)
    workdir_lib.check(workdir, create=False)
    return [argv[0], f'--config={WORKDIR_CONFIG_FILE}:{workdir}', *argv[1:]]


def main(command: Callable[[list[str]], Any], config_from_workdir: bool = False) -> None:
    """`absl.app.run(command)` where a bad flag or a user error ends with one line.

    With `config_from_workdir` (the flags of `define_workdir_flags`), a command given no --config
    runs with its workdir's own (`with_workdir_config`).
    """
    collector.tune()  # The command's modules are imported by now; they stay for the process's life.
    if config_from_workdir:
        try:
            sys.argv = with_workdir_config(sys.argv)  # Read by absl and by the config flag's overrides.
        except errors.UserError as error:
            fail(error, error.label, error.exit_code)

    def guarded(argv: list[str]) -> Any:
        try:
            return command(argv)
        except errors.UserError as error:
            fail(error, error.label, error.exit_code)
        except Exception as error:  # pylint: disable=broad-except
            if isinstance(error, jax.errors.JaxRuntimeError) and errors.is_out_of_memory(str(error)):
                out_of_memory = _out_of_memory(error)
                fail(out_of_memory, out_of_memory.label, out_of_memory.exit_code)
            traceback.print_exc()  # A bug: keep its traceback, but do not hang on the way out.
            _exit_now(1)

    app.run(guarded, flags_parser=_parse_flags)


def _config_field_hint(message: str) -> str:
    """For an unknown flag that is a config field (`--num_steps=3`): where the field is."""
    unknown = re.match(r"Unknown command line flag '(\w+)'", message)
    if not unknown:
        return ''
    config = config_lib.base_config()
    where = [f'--config.{section}.{unknown.group(1)}=...' for section, fields in config.items()
             if isinstance(fields, ml_collections.ConfigDict) and unknown.group(1) in fields]
    return f'; a config field is set as {" or ".join(where)}' if where else ''


def _out_of_memory(error: Exception) -> errors.OutOfMemoryError:
    """A device allocation that failed mid-run (the state's own size is checked before it starts)."""
    detail = re.search(r'Out of memory[^.\n]*', str(error))
    out_of_memory = errors.OutOfMemoryError(
        f'a step did not fit the device\'s memory ({detail.group(0) if detail else "RESOURCE_EXHAUSTED"}): '
        'lower the batch size, tgt_len or mem_len (config.train, config.eval), in training raise '
        'config.train.grad_accum_steps or set config.model.remat=full, or shard over more devices (config.mesh).')
    out_of_memory.__cause__ = error
    return out_of_memory


def _load_hint(last: str) -> str:
    """What to do about a config file that does not load, from the last line of what it raised."""
    if last.startswith('ValueError: '):  # A config file's own (an unknown ':argument'): its words say.
        return ''
    if 'positional argument' in last:
        return ' (the part after ":" is get_config()\'s argument: drop it, or give one get_config() takes)'
    if 'Could not override field' in last:
        return (' (the file sets a field to a value of another type than its default: see the field in '
                'memjax/config_lib.py)')
    if last.startswith(('No such file', '[Errno', 'it defines no')):
        return ' (give the path of a configs/*.py file that defines get_config())'
    return ' (fix the file; --verbose shows where)'


def _config_error(error: Exception, argv: Sequence[str] = ()) -> errors.ConfigError:
    """The ConfigError for what ml_collections raises while loading a config file: OSError for
    a file that does not load, KeyError/AttributeError (with a did-you-mean) for an unknown field."""
    if isinstance(error, AttributeError) and 'get_config' in str(error):
        error = OSError('it defines no get_config()')
    if isinstance(error, OSError):
        files = [a.split('=', 1)[1] for a in argv if a.startswith('--config=')]
        where = f'--config={files[-1]}' if files else 'the --config file'
        last = str(error).splitlines()[-1].strip()
        return errors.ConfigError(f'{where} does not load: {last.removeprefix("ValueError: ").rstrip(".")}'
                                  f'{_load_hint(last)}.')
    detail = str(error.args[0] if error.args else error).replace('\\n', ' ').replace("\\'", "'")
    name = re.match(r"""\W*(\w+)""", detail)
    given = [a[2:].split('=', 1)[0] for a in argv
             if name and re.match(rf'--config\.[\w.]*\b{name.group(1)}=', a)]
    hint = re.search(r'Did you mean[^?]*\?', detail)
    return errors.ConfigError(
        f'unknown config field {given[0] if given else detail.split()[0]}'
        f'{". " + hint.group(0) if hint else ""} (every field and its default: '
        'memjax/config_lib.py).')


def load_config(config_flag: flags.FlagHolder) -> ml_collections.ConfigDict:
    """The value of a `config_flags.DEFINE_config_file` flag, or a ConfigError.

    ml_collections loads the file on first access (or while parsing overrides).
    """
    try:
        config = config_flag.value
        if config is not None:
            config['model']  # pylint: disable=pointless-statement  (a file that failed raises here)
        return config
    except (OSError, KeyError, AttributeError) as error:
        if isinstance(error, KeyError) and error.args == ('model',):
            raise errors.ConfigError(f'{flags.FLAGS[config_flag.name].config_filename} has no '
                                     'model section: start from memjax.config_lib.base_config().'
                                     ) from error
        raise _config_error(error, sys.argv) from error


def load_run(config_flag: flags.FlagHolder) -> Optional[config_lib.RunConfig]:
    """The config of `config_flag` resolved once, for this run's processes and devices (None: no
    --config given). A multi-process command calls it inside `run`'s job, once they are joined."""
    config = load_config(config_flag)
    return None if config is None else config_lib.resolve(config, jax.process_count(), jax.device_count())


def prepare_host_memory() -> bool:
    """Applies --host_memory; must run before JAX first touches a device."""
    return host_memory.keep_host_buffers(_HOST_MEMORY.value)


def run(job: Callable[[], Any]) -> Any:
    """Sets up host memory and joins the distributed run before anything touches a device, quiets
    library logs and runs `job` so that a dead peer ends it."""
    prepare_host_memory()
    logs.quiet_library_logs(verbose=_VERBOSE.value)
    distributed.initialize_from_flags()
    distributed.set_log_verbosity()
    with distributed.peer_failures_end_the_run():
        result = job()
    peer_watch.ended(0)
    return result
