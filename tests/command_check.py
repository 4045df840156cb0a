"""Checks command lines without running their jobs; run by tests/test_documented_commands.py.

`python tests/command_check.py WORKDIR` reads a JSON list of commands (argv lists, `python -m`
dropped: [module, arg, ...]) on stdin and prints one JSON list: for each, None or what is wrong.
A command is checked as its module would take it: absl parses its flags (a config file loaded
with its `:arguments` and `--config.a.b=v` overrides) and the config resolves; suites and sweeps
named exist. Placeholders (`...`, `<...>`, a shell variable, configs/X.py) are kept to what can be checked: a
bare `...` or a config file to fill in makes a fragment, whose flag names alone are checked; a
placeholder value checks its flag's name (a config field: that it exists). Capitals (DIR, CORPUS)
are values as given. A command that reads a trained workdir without --config reads WORKDIR's
config.json.

All in one process, one module group after another: each group's flags are removed before the
next one defines its own (the commands share names such as --config).
"""

import contextlib
import importlib
import io
import json
import re
import sys
from typing import Optional

from absl import flags

from memjax import cli
from memjax import config_lib

FLAGS = flags.FLAGS
# Modules whose flags are defined together (sweep and compare take memjax.evaluate's).
GROUPS = (('memjax.train',), ('memjax.evaluate', 'memjax.sweep', 'memjax.compare'), ('memjax.generate',),
          ('memjax.bench.__main__',), ('memjax.recl',))
READS_WORKDIR = ('memjax.evaluate', 'memjax.sweep', 'memjax.generate')
PLACEHOLDER = re.compile(r'.*(\.\.\.|\$|<|\bX\.py).*')


def _flag(arg: str) -> tuple[str, Optional[str]]:
    name, _, value = arg.lstrip('-').partition('=')
    return name, value if '=' in arg else None


def _own_flag(name: str) -> bool:
    return name in FLAGS or (name.startswith('no') and name[2:] in FLAGS)


def _check_names(args: list[str]) -> Optional[str]:
    unknown = [a for a in args if a.startswith('-') and not _flag(a)[0].startswith('config.')
               and not _own_flag(_flag(a)[0])]
    return f'unknown flags {unknown}' if unknown else None


def _check_absl(module: str, args: list[str], workdir: str) -> Optional[str]:
    """The command's flags as absl parses them, its config resolved, its positional names known."""
    if not args:  # The module named in prose.
        return None
    if '...' in args or any(_flag(a)[0] == 'config' and PLACEHOLDER.fullmatch(_flag(a)[1] or '') for a in args):
        return _check_names([a for a in args if a != '...'])
    fields, kept = [], []
    for arg in args:
        name, value = _flag(arg)
        if value is not None and PLACEHOLDER.fullmatch(value) and name != 'workdir':
            if name.startswith('config.'):
                fields.append(name[len('config.'):])
            elif not _own_flag(name) and name != 'config':
                return f'unknown flag --{name}'
            continue  # A value to fill in: the name is what the page can get wrong.
        kept.append(arg)
    reads_workdir = module in READS_WORKDIR and not any(_flag(a)[0] == 'config' for a in kept)
    if reads_workdir:  # The documented run's workdir does not exist here: one like it does.
        kept = [a for a in kept if _flag(a)[0] != 'workdir'] + [f'--workdir={workdir}']
    argv = cli.with_workdir_config([module, *kept]) if reads_workdir else [module, *kept]
    sys.argv = argv  # The config flag reads its overrides there.
    try:
        positional = FLAGS(argv)[1:]
        config = FLAGS['config'].value if 'config' in FLAGS else None  # memjax.recl takes workdirs.
        for field in fields:  # Dotted paths, as --config.a.b names them.
            node = config
            for part in field.split('.'):
                node = node[part]
        if config is not None:
            config_lib.resolve(config)
    except (flags.Error, KeyError, AttributeError, ValueError, OSError) as error:
        return f'{type(error).__name__}: {" ".join(str(error).split())[:300]}'
    return _check_positional(module, positional)


def _check_positional(module: str, positional: list[str]) -> Optional[str]:
    if module == 'memjax.bench.__main__':
        from memjax.bench import harness  # pylint: disable=g-import-not-at-top
        unknown = [s for s in positional if not PLACEHOLDER.fullmatch(s) and s not in harness.available_suites()]
        return f'unknown suites {unknown}' if unknown else None
    if module == 'memjax.sweep':
        from memjax import sweep  # pylint: disable=g-import-not-at-top
        return None if len(positional) == 1 and positional[0] in sweep.SWEEPS else f'not one sweep: {positional}'
    return f'unexpected arguments {positional}' if positional else None


def _check_by_help(module: str, args: list[str]) -> Optional[str]:
    """A command with a parser of its own (the importers, the corpus tool): its --help names each
    flag. A module that runs as a script without one (a suite's worker process) exists."""
    main = getattr(importlib.import_module(module), 'main', None)
    if main is None:
        return None
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown), contextlib.suppress(SystemExit):
        main(['--help'])
    unknown = [a for a in args if a.startswith('--') and f'--{_flag(a)[0]}' not in shown.getvalue()]
    return f'unknown flags {unknown}' if unknown else None


def _remove_flags(modules: tuple[str, ...]) -> None:
    """The modules' own flags (--config and --workdir of those that read a workdir: memjax.cli
    defines them) and the config overrides a parse defined."""
    own = {f.name for m in modules for f in FLAGS.get_flags_for_module(m)}
    if modules:
        own |= {'config', 'workdir'}
    for name in list(FLAGS):
        if name in own or name.startswith('config.'):
            delattr(FLAGS, name)


def main() -> None:
    workdir = sys.argv[1]
    commands = json.load(sys.stdin)
    results: list[Optional[str]] = [None] * len(commands)
    grouped = {m for group in GROUPS for m in group}
    for group in GROUPS:
        for module in group:
            importlib.import_module(module)
        for i, (module, *args) in enumerate(commands):
            if module in group:
                FLAGS.unparse_flags()
                _remove_flags(())  # The previous command's config overrides.
                results[i] = _check_absl(module, args, workdir)
        _remove_flags(group)
    for i, (module, *args) in enumerate(commands):
        if module not in grouped:
            try:
                results[i] = _check_by_help(module, args)
            except ImportError as error:
                results[i] = f'no module {module}: {error}'
    print(json.dumps(results))


if __name__ == '__main__':
    main()
