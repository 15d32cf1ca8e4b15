"""``tune run --nproc_per_node N`` ends like its workers: exit 130/143 without torchrun's traceback when
interrupted, and exit 2 (or 1) with a user-facing error's line once, without torchrun's log lines about those
workers (:func:`_exit_like_interrupted_workers`, which says why; applied as ``torchtune._cli.run`` is imported)."""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import types
from pathlib import Path
from typing import Any, Dict, Optional

from torchtune_ext._compat._warnings import DropRecords


def _exit_like_interrupted_workers(run_module: types.ModuleType) -> None:
    """Wraps torchtune's distributed launch (``Run._run_distributed``, which calls torchrun) so that an interrupt
    ends ``tune run --nproc_per_node N`` with the conventional exit code and no traceback.

    Why: our workers save on SIGINT/SIGTERM and exit ``128 + signal`` (:mod:`torchtune_ext.training._interrupt`),
    but torchrun turns both ways an interrupt reaches it into a traceback and exit code 1: a signal to the launcher
    itself (a terminal's Ctrl-C reaches the whole process group; a runtime's SIGTERM) raises its ``SignalException``
    after it has forwarded the signal and waited for the workers, and workers that exited 130/143 are a
    ``ChildFailedError`` with its failure block. Here the first exits ``128 + signal`` quietly, the second exits
    with the workers' code when every failed worker exited with the same 130 or 143. A config error
    (:data:`torchtune_ext.config.CONFIG_ERROR_EXIT_CODE`, see ``exit_on_config_error``) exits 2 the same way, so it
    is one line under torchrun too, and so does any other user-facing error (a divergence, a failed write: exit 1):
    every rank finds it, rank 0 prints it, and the ranks torchrun stopped with SIGTERM once the first had exited
    count as stopped by it; where rank 0 was stopped before it printed, the line
    is printed here, as another rank wrote it into a folder this wrap gives the workers (a torchrun error file
    would add torchrun's own log lines). Any other failure is torchrun's, unchanged.
    Idempotent."""
    import functools
    import logging

    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from torchtune_ext.config import CONFIG_ERROR_DIR_ENV, CONFIG_ERROR_EXIT_CODE

    interrupted_codes = {128 + int(s) for s in (signal.SIGINT, signal.SIGTERM)}
    launch = run_module.Run._run_distributed
    if getattr(launch, "_exits_like_interrupted_workers", False):
        return
    # torchrun's agent logs "failed (exitcode: N) local_rank: ..." for the first worker that ended, and "Sending
    # process P closing signal SIGTERM" for each it then stops: for 2, 130 and 143 (and 1 where a worker wrote a
    # user-facing error's lines) the workers printed why and the launcher exits with the code; any other failure
    # keeps torchrun's report (each worker's exit code and signal).
    quiet = {CONFIG_ERROR_EXIT_CODE, *interrupted_codes}

    def explained(code: int) -> bool:
        folder = os.environ.get(CONFIG_ERROR_DIR_ENV)
        return code in quiet or code == 1 and bool(folder) and any(Path(folder).glob("rank_*.txt"))

    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(
        DropRecords(
            lambda r: (
                str(r.msg).startswith("Sending process %s closing signal")
                or str(r.msg).startswith("failed (exitcode: ")
                and bool(r.args)
                and explained(r.args[0])
            )
        )
    )

    @functools.wraps(launch)
    def run_distributed(self: Any, *args: Any, **kwargs: Any) -> Any:
        with tempfile.TemporaryDirectory(prefix="torchtune_ext_config_errors_") as folder:
            os.environ[CONFIG_ERROR_DIR_ENV] = folder  # the workers inherit it
            try:
                return launch(self, *args, **kwargs)
            except SignalException as error:
                sys.exit(128 + int(error.sigval))
            except ChildFailedError as error:
                codes = {failure.exitcode for failure in error.failures.values()}
                code = _user_facing_exit_code(error.failures, Path(folder))
                if code is not None:
                    _print_config_error_once(error.failures, Path(folder), code)
                    sys.exit(code)
                if len(codes) == 1 and codes <= interrupted_codes:
                    sys.exit(codes.pop())
                raise
            finally:
                os.environ.pop(CONFIG_ERROR_DIR_ENV, None)

    run_distributed._exits_like_interrupted_workers = True  # type: ignore[attr-defined]
    run_module.Run._run_distributed = run_distributed


def _user_facing_exit_code(failures: Dict[int, Any], folder: Path) -> Optional[int]:
    """The exit code of the workers stopped by a user-facing error (``exit_on_config_error``), the others having
    been stopped by torchrun (SIGTERM); None for any other failure. A config error's code (2) is its own; a code 1
    counts only where every worker that exited 1 wrote its error's lines into ``folder`` (a crash exits 1 too)."""
    from torchtune_ext.config import CONFIG_ERROR_EXIT_CODE

    codes = {failure.exitcode for failure in failures.values()} - {-int(signal.SIGTERM)}
    if codes == {CONFIG_ERROR_EXIT_CODE}:
        return CONFIG_ERROR_EXIT_CODE
    written = {path.name for path in folder.glob("rank_*.txt")}
    failed = [rank for rank, failure in failures.items() if failure.exitcode == 1]
    if codes == {1} and all(f"rank_{rank}.txt" in written for rank in failed):
        return 1
    return None


def _print_config_error_once(failures: Dict[int, Any], folder: Path, code: int) -> None:
    """Prints a user-facing error's lines where rank 0 did not (it did where it exited with ``code``, see
    ``exit_on_config_error``), as the lowest rank that found it wrote them into ``folder``."""
    if 0 in failures and failures[0].exitcode == code:
        return
    written = sorted(folder.glob("rank_*.txt"), key=lambda path: int(path.stem[5:]))
    if written:
        print(written[0].read_text(), end="", file=sys.stderr, flush=True)
