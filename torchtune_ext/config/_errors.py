"""The errors whose message says what happened and what to do (bad configs and inputs, a diverged run, a failed
write), and how the entry points print them: their lines, no traceback (``TORCHTUNE_EXT_TRACEBACK=1`` shows it)."""

from __future__ import annotations

import functools
import os
import signal
import sys
from typing import Any, Callable, TypeVar

#: set to 1 to get the traceback of a config error instead of its one-line message.
TRACEBACK_ENV = "TORCHTUNE_EXT_TRACEBACK"
#: the exit code of a run stopped by a config error (argparse's code for bad usage).
CONFIG_ERROR_EXIT_CODE = 2

F = TypeVar("F", bound=Callable[..., Any])
#: a folder ``tune run --nproc_per_node N`` gives its workers for their config errors (``torchtune_ext._compat``).
CONFIG_ERROR_DIR_ENV = "TORCHTUNE_EXT_CONFIG_ERROR_DIR"


class UserFacingError(Exception):
    """A failure whose message is the whole report: what happened, what was kept, what to do. The entry points
    (:func:`exit_on_config_error`) print its lines without a traceback and exit with :attr:`exit_code`."""

    #: the exit code of a run stopped by it.
    exit_code = 1


class MissingExtraError(UserFacingError, ImportError):
    """An optional extra (``eval``, ``gguf``, ...) is not installed: one line with the command that installs it. Also
    an ``ImportError``, what code importing an optional module expects."""


class ConfigError(UserFacingError, ValueError):
    """A bad config value or input file, found before anything is written. Its message is one line per problem, each
    naming the key, the value and the fix.

    Args:
        message (str): the problem(s), one per line.
        key (str): the config key at fault (the first one, when several are).
    """

    exit_code = CONFIG_ERROR_EXIT_CODE

    def __init__(self, message: str, key: str = ""):
        super().__init__(message)
        self.key = key


class ConfigFileNotFoundError(ConfigError, FileNotFoundError):
    """A file or folder the config names does not exist (also a ``FileNotFoundError``)."""


def bad_value(key: str, value: Any, problem: str, fix: str = "") -> ConfigError:
    """
    Args:
        key (str): the config key, e.g. ``model.lora_rank``.
        value (Any): its value.
        problem (str): what is wrong with it.
        fix (str): what to set instead (none where ``problem`` says it).

    Returns:
        ConfigError: ``"<key>=<value> <problem>; <fix>"``.
    """
    return ConfigError(f"{key}={value!r} {problem}" + (f"; {fix}" if fix else ""), key)


def print_config_error(error: UserFacingError, prog: str) -> None:
    """Prints ``<prog>: error: <line>`` for each line of the error to stderr."""
    for line in str(error).splitlines():
        print(f"{prog}: error: {line}", file=sys.stderr, flush=True)


def _report_to_launcher(error: UserFacingError, prog: str) -> None:
    """Under ``tune run --nproc_per_node N``, writes the error's lines where the launcher looks: when another rank
    exits first and torchrun stops rank 0 before it printed them, the launcher prints them
    (``torchtune_ext._compat``)."""
    folder = os.environ.get(CONFIG_ERROR_DIR_ENV)
    if not folder or not os.path.isdir(folder):
        return
    lines = "".join(f"{prog}: error: {line}\n" for line in str(error).splitlines())
    path = os.path.join(folder, f"rank_{int(os.environ.get('RANK', '0'))}.txt")
    with open(f"{path}.tmp", "w") as file:
        file.write(lines)
    os.replace(f"{path}.tmp", path)  # the launcher never reads half a message


def exit_on_config_error(prog: str) -> Callable[[F], F]:
    """Decorates an entry point: a :class:`UserFacingError` prints its line(s) (rank 0 only under a launcher) and
    exits with its ``exit_code`` (:data:`CONFIG_ERROR_EXIT_CODE` for a :class:`ConfigError`), without a traceback
    unless ``TORCHTUNE_EXT_TRACEBACK=1``.

    Args:
        prog (str): the name the lines start with (the recipe's or the command's).

    Returns:
        Callable[[F], F]: the decorator.
    """

    def decorate(main: F) -> F:
        @functools.wraps(main)
        def run(*args: Any, **kwargs: Any) -> Any:
            try:
                return main(*args, **kwargs)
            except UserFacingError as error:
                if os.environ.get(TRACEBACK_ENV, "") == "1":
                    raise
                _report_to_launcher(error, prog)
                if int(os.environ.get("RANK", "0")) == 0:
                    # torchrun stops the other workers with SIGTERM once one has exited: not before the line is out.
                    signal.signal(signal.SIGTERM, signal.SIG_IGN)
                    print_config_error(error, prog)
                sys.exit(error.exit_code)

        return run  # type: ignore[return-value]

    return decorate
