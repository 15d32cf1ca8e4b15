"""The recipe state: everything a run saves to resume, in one typed place, and everything a resume checks.

- **Data, not code.** It is saved as tensors and plain Python types only (the numpy RNG state converted to a tensor and
  numbers) and loaded with ``torch.load(weights_only=True)``: a file carrying any other object (a pickled callable
  from a shared notebook's outputs) is refused before anything in it runs (:class:`UnsafeRecipeStateError`).
- **The last two are kept**: ``recipe_state.pt`` and ``recipe_state.prev.pt``. A newest one that cannot be read
  (truncated, corrupt) falls back to the previous one, saying so.
- **A resume is the same run, or it is refused.** :class:`RunIdentity` (``_run_identity``) records what defines
  the run (the model builder and its arguments, LoRA settings, dtypes, the base checkpoint's files, the tokenizer's
  files (by content, wherever they lie), the data set's config and size, the global batch, seed and shuffle); a
  resume that differs in any of it is refused before any weight loads, listing each difference (``model.lora_alpha:
  16 -> 4``). Every other config key is a deliberate setting (lr, epochs, logging, save cadence): changes are
  allowed and listed.
- **The data position is global** (:class:`DataPosition`): the samples of the epoch consumed over all ranks, the
  epoch, the sampler's seed and shuffle. Every world size walks the same shuffled order (rank ``r`` of ``W`` takes
  every ``W``-th index), so a resume on any number of ranks with the same global batch continues at exactly that
  sample and trains what an uninterrupted run trains.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import re
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

import numpy as np
import torch
from torchtune import utils

from torchtune_ext.checkpoint._atomic import atomic_save
from torchtune_ext.checkpoint._run_identity import RunIdentity, batch_hint, differences, identity_differences
from torchtune_ext.config import ConfigError, ConfigFileNotFoundError

log = utils.get_logger("INFO")

PathLike = Union[str, Path]

#: Version of the saved layout; an older file is refused with the reason.
RECIPE_STATE_FORMAT = 2
#: the config key a bad recipe state file is reported under.
KEY = "checkpointer.recipe_checkpoint"
_REQUIRED = ("format", "global_step", "epochs_run", "identity", "settings", "position", "adapter", "optimizer")


class UnsafeRecipeStateError(ConfigError):
    """A recipe state file holds Python objects other than tensors and plain data; it was not loaded."""


# ---------------------------------------------------------------------------------------------------------- RNG


def plain_rng_state(state: Dict[str, Any]) -> Dict[str, Any]:
    """An RNG state of ``torchtune_ext.training.rng_state`` as tensors and plain types (loadable with
    ``weights_only=True``)."""
    version, internal, gauss = state["python"]
    name, keys, pos, has_gauss, cached = state["numpy"]
    plain = {
        "torch": state["torch"],
        "python": [int(version), torch.tensor(internal, dtype=torch.int64), gauss],
        "numpy": [str(name), torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos), int(has_gauss), cached],
    }
    if "cuda" in state:
        plain["cuda"] = state["cuda"]
    return plain


def native_rng_state(plain: Dict[str, Any]) -> Dict[str, Any]:
    """The inverse of :func:`plain_rng_state`: what ``torchtune_ext.training.set_rng_state`` takes."""
    version, internal, gauss = plain["python"]
    name, keys, pos, has_gauss, cached = plain["numpy"]
    state = {
        "torch": plain["torch"],
        "python": (version, tuple(int(x) for x in internal.tolist()), gauss),
        "numpy": (name, keys.numpy().astype(np.uint32), pos, has_gauss, cached),
    }
    if "cuda" in plain:
        state["cuda"] = plain["cuda"]
    return state


# -------------------------------------------------------------------------------------------------- data position


@dataclass
class DataPosition:
    """Where the run is in its data, over all ranks.

    Args:
        epoch (int): the epoch in progress (or about to start).
        samples_consumed (int): samples of this epoch's shuffled order already trained, over all ranks.
        dataset_size (int): samples in the data set.
        seed (int): the sampler's seed (the order of epoch ``e`` is drawn with ``seed + e``).
        shuffle (bool): whether the sampler shuffles.
        world_size (int): ranks of the run that saved it.
    """

    epoch: int
    samples_consumed: int
    dataset_size: int
    seed: int
    shuffle: bool
    world_size: int

    def per_rank_start(self, world_size: int) -> int:
        """The number of its own indices each of ``world_size`` ranks skips to continue at ``samples_consumed``
        (rank ``r`` takes indices ``r, r + W, ...`` of the shuffled order).

        Raises:
            ConfigError: if the position does not split over ``world_size`` ranks (another global batch).
        """
        if self.samples_consumed % world_size:
            raise ConfigError(
                f"The recipe state is at sample {self.samples_consumed} of the epoch, which does not split over "
                f"{world_size} ranks; resume with the saved global_batch_size.",
                "global_batch_size",
            )
        return self.samples_consumed // world_size


# ------------------------------------------------------------------------------------------------- recipe state


@dataclass
class RecipeState:
    """Everything a run saves to resume and checks on resume.

    Args:
        global_step (int): optimizer steps done.
        epochs_run (int): epochs completed.
        steps_in_epoch_done (int): optimizer steps done in the epoch in progress.
        total_epochs (int): the run's ``epochs`` when saved.
        max_steps_per_epoch (Optional[int]): the run's ``max_steps_per_epoch`` (the resume keeps it).
        identity (Dict[str, Any]): :attr:`RunIdentity.identity` of the saved run.
        settings (Dict[str, Any]): :attr:`RunIdentity.settings` of the saved run.
        position (DataPosition): the global data position.
        adapter (Dict[str, torch.Tensor]): adapter tensors under the model's unwrapped keys.
        optimizer (Dict[str, Any]): the full (unsharded) optimizer state.
        lr_scheduler (Dict[str, Any]): the LR scheduler's state.
        loss_scaler (Dict[str, Any]): the loss scaler's state.
        rng_per_rank (List[Dict[str, Any]]): every rank's RNG states, plain (:func:`plain_rng_state`).
        kept_ids (Optional[List[int]]): vocab pruning's kept token ids.
        checkpoint (Optional[str]): the name of the step folder saved with it (in the output folder).
        metric_log_dir (Optional[str]): the metric logger's folder, which a resume continues writing into.
    """

    global_step: int
    epochs_run: int
    steps_in_epoch_done: int
    total_epochs: int
    max_steps_per_epoch: Optional[int]
    identity: Dict[str, Any]
    settings: Dict[str, Any]
    position: DataPosition
    adapter: Dict[str, torch.Tensor]
    optimizer: Dict[str, Any]
    lr_scheduler: Dict[str, Any]
    loss_scaler: Dict[str, Any]
    rng_per_rank: List[Dict[str, Any]]
    kept_ids: Optional[List[int]] = None
    checkpoint: Optional[str] = None
    metric_log_dir: Optional[str] = None
    #: where it was loaded from (not saved).
    source: Optional[Path] = field(default=None, compare=False)

    # ------------------------------------------------------------------------------------------------ storage

    def to_dict(self) -> Dict[str, Any]:
        """The saved form: tensors and plain types only."""
        state = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "source"}
        state["position"] = dataclasses.asdict(self.position)
        # Also at the top level: the dtype the adapters trained in (for tools that read the file).
        return {"format": RECIPE_STATE_FORMAT, "dtype": self.identity.get("dtype"), **state}

    @classmethod
    def from_dict(cls, state: Any, source: Optional[Path] = None) -> RecipeState:
        """
        Raises:
            ConfigError: if ``state`` is not a recipe state of this format.
        """
        where = source or "the recipe state"
        if not isinstance(state, dict) or state.get("format") != RECIPE_STATE_FORMAT:
            found = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise ConfigError(
                f"{where} is not a readable recipe state (format {found}, expected {RECIPE_STATE_FORMAT}: written by "
                "another version of torchtune_ext?).",
                KEY,
            )
        missing = [k for k in _REQUIRED if k not in state]
        if missing:
            raise ConfigError(f"{where} is not a readable recipe state (it lacks {missing}).", KEY)
        names = {f.name for f in dataclasses.fields(cls)} - {"source"}
        values = {k: v for k, v in state.items() if k in names}
        values["position"] = DataPosition(**state["position"])
        return cls(**values, source=source)

    def save(self, path: PathLike) -> Path:
        """Writes the state atomically to ``path``, keeping the one it replaces as ``previous_path(path)``: at every
        moment both names hold a complete state (a hard link, else a copy, is renamed into place first).

        Returns:
            Path: ``path``.
        """
        path = Path(path)
        if path.is_file():
            _replace_with_copy(path, previous_path(path))
        atomic_save(self.to_dict(), path)
        return path

    @classmethod
    def load(cls, path: PathLike) -> RecipeState:
        """Loads ``path`` with ``torch.load(weights_only=True)``; if it cannot be read, the previous one, saying so.

        Raises:
            ConfigFileNotFoundError: if neither exists.
            UnsafeRecipeStateError: if the file holds anything but tensors and plain data (nothing of it runs).
            ConfigError: if neither is a readable recipe state.
        """
        path = Path(path)
        previous = previous_path(path)
        if not path.is_file() and not previous.is_file():
            raise ConfigFileNotFoundError(
                f"resume_from_checkpoint=True but {path} does not exist: resume with the same output_dir as the "
                "interrupted run, or set checkpointer.recipe_checkpoint to its recipe_state.pt.",
                "resume_from_checkpoint",
            )
        try:
            return cls._read(path)
        except UnsafeRecipeStateError:
            raise
        except (OSError, ValueError) as err:
            if not previous.is_file():
                raise
            try:
                state = cls._read(previous)
            except (OSError, ValueError) as previous_err:
                raise ConfigError(f"{err} The previous one is not readable either: {previous_err}", KEY) from err
            utils.log_rank_zero(
                log,
                f"{err} Resuming from the previous recipe state instead: {previous} (step {state.global_step}); "
                "the steps after it are trained again.",
            )
            return state

    @classmethod
    def _read(cls, path: Path) -> RecipeState:
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist.")
        try:
            raw = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            # A reference to any class or function (a callable to call on load) is refused; other errors are damage.
            found = re.search(r"GLOBAL ([\w.]+)", str(err))
            if found is None:
                raise ConfigError(
                    f"{path} is not a readable recipe state ({_unpickling_reason(err)}). Delete it "
                    "to start over, or set checkpointer.recipe_checkpoint to another recipe_state.pt.",
                    KEY,
                ) from None
            raise UnsafeRecipeStateError(
                f"{path} holds Python objects, not only tensors and plain data (it references {found.group(1)})"
                + "; it was not loaded and nothing in it ran. A recipe state of this version never does: it was "
                "written by an older torchtune_ext or altered. Delete it to start over, or set "
                "checkpointer.recipe_checkpoint to a recipe state you trust.",
                KEY,
            ) from None
        except Exception as err:
            reason = str(err).splitlines()[0].split(". ")[0][:200] if str(err) else ""  # torch's advice follows
            raise ConfigError(
                f"{path} is not a readable recipe state ({type(err).__name__}: {reason}). Delete it to "
                "start over, or set checkpointer.recipe_checkpoint to another recipe_state.pt.",
                KEY,
            ) from err
        return cls.from_dict(raw, source=path)

    # --------------------------------------------------------------------------------------------- the resume

    def check_resume(self, run: RunIdentity, kept_ids: Optional[List[int]], total_epochs: int) -> List[str]:
        """Checks that this run is the saved one, before any weight loads.

        Args:
            run (RunIdentity): this run's identity and settings.
            kept_ids (Optional[List[int]]): this run's vocab-pruning kept ids.
            total_epochs (int): this run's ``epochs``.

        Returns:
            List[str]: lines to log: the allowed changes, the tokenizer files an older state did not record, and that
            the run had finished (where it had; where it
            resumes is :meth:`describe_position`, once the data is loaded).

        Raises:
            ConfigError: listing every difference in what defines the run; or if ``stop_after_step`` is one the
                saved run has reached (it would train one step and stop again).
        """
        changed, lines = identity_differences(RunIdentity(self.identity, self.settings), run)
        if self.kept_ids != kept_ids:
            changed.append("vocab_pruning kept token ids: differ (another data set or kept_ids file)")
        if changed:
            raise ConfigError(
                f"resume_from_checkpoint=True, but this run is not the one saved in {self.source} (step "
                f"{self.global_step}); it differs in what defines the run:\n  "
                + "\n  ".join(changed + batch_hint(self.identity, run.identity))
                + "\nResume with the saved values, or start a new run in another output_dir.",
                "resume_from_checkpoint",
            )
        self._check_stop_after_step(run.settings.get("stop_after_step"), total_epochs)
        allowed = differences(self.settings, run.settings)
        if allowed:
            lines.append("Resuming with changed settings (allowed):\n  " + "\n  ".join(allowed))
        if self.epochs_run >= total_epochs:
            folder = self.checkpoint_path
            outputs = [] if folder is None else [str(folder / "adapter")]
            outputs += [str(folder / "merged")] if folder is not None and (folder / "merged").is_dir() else []
            lines.append(
                f"This run had already finished: step {self.global_step}, epoch {self.epochs_run} of {total_epochs}; "
                f"nothing is left to train. Its outputs: {', '.join(outputs) or '(none recorded)'}. To train "
                f"further, raise epochs (e.g. epochs={self.epochs_run + 1}) and resume."
            )
        return lines

    def _check_stop_after_step(self, stop_after_step: Optional[int], total_epochs: int) -> None:
        """A ``stop_after_step`` the saved run has reached would train one step per resume: refused."""
        if stop_after_step is None or self.epochs_run >= total_epochs or stop_after_step > self.global_step:
            return
        raise ConfigError(
            f"stop_after_step={stop_after_step}, but the run saved in {self.source} has reached step "
            f"{self.global_step}: resume without stop_after_step to train to the end, or with a later one (e.g. "
            f"stop_after_step={self.global_step + stop_after_step}).",
            "stop_after_step",
        )

    @property
    def checkpoint_path(self) -> Optional[Path]:
        """The step folder saved with this state: next to the ``recipe_state/`` folder it was loaded from."""
        if self.checkpoint is None or self.source is None:
            return None
        return self.source.parent.parent / self.checkpoint

    def describe_position(self, world_size: int, epoch: int, batch: int) -> str:
        """The resume's line, e.g. ``Resumed from step 3 (epoch 1, batch 6): sample 24 of 64, on 1 rank; saved on 2.``

        Args:
            world_size (int): this run's number of ranks.
            epoch (int): the epoch (from 1) of the last completed step, as the interrupt message named it.
            batch (int): that epoch's batches done.
        """
        position = self.position
        ranks = "rank" if world_size == 1 else "ranks"
        data = f"sample {position.samples_consumed} of {position.dataset_size}"
        if position.epoch + 1 != epoch:  # resumed between epochs: the next one starts
            data = f"epoch {position.epoch + 1} starts at {data}"
        return (
            f"Resumed from step {self.global_step} (epoch {epoch}, batch {batch}): {data}, on {world_size} {ranks}; "
            f"saved on {position.world_size}."
        )

    def restore_optimizer_(self, optimizer: torch.optim.Optimizer, load: Any) -> List[Dict[str, Any]]:
        """Loads the optimizer state with ``load(optimizer, state)``, then gives the param groups back this run's
        hyperparameters (a changed ``weight_decay``, say, takes effect; the LR is set with the scheduler).

        Returns:
            List[Dict[str, Any]]: this run's param-group hyperparameters, for :meth:`restore_lr_scheduler_`.
        """
        fresh = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
        load(optimizer, self.optimizer)
        for group, hyper in zip(optimizer.param_groups, fresh):
            group.update({k: v for k, v in hyper.items() if k not in ("lr", "initial_lr")})
        return fresh

    def restore_lr_scheduler_(self, scheduler: Any, fresh: List[Dict[str, Any]]) -> None:
        """Loads the scheduler's state; where this run's lr differs from the saved one, the schedule continues
        from the same step with the new peak lr. A run whose optimizer has another number of param groups than the
        saved one (another world size, or a state of one group) gives every group the saved first group's values:
        the groups are built from one optimizer config, so they agree."""
        scheduler.load_state_dict(_per_group(self.lr_scheduler, len(scheduler.optimizer.param_groups)))
        lambdas = getattr(scheduler, "lr_lambdas", None)
        for i, (group, hyper) in enumerate(zip(scheduler.optimizer.param_groups, fresh)):
            if lambdas is None or hyper["lr"] == group.get("initial_lr"):
                continue
            group["initial_lr"] = scheduler.base_lrs[i] = hyper["lr"]
            group["lr"] = hyper["lr"] * lambdas[i](scheduler.last_epoch)

    def restore_sampler_(self, sampler: Any, world_size: int) -> None:
        """Puts a ``StatefulDistributedSampler`` of this run (any number of ranks) at the saved global sample.

        Raises:
            ConfigError: if the sampler's seed or shuffle differ from the saved ones.
        """
        position = self.position
        if (sampler.seed, bool(sampler.shuffle)) != (position.seed, position.shuffle):
            raise ConfigError(
                f"The data sampler (seed {sampler.seed}, shuffle {sampler.shuffle}) differs from the saved one "
                f"(seed {position.seed}, shuffle {position.shuffle}): resume with the saved seed and shuffle.",
                "seed",
            )
        sampler.load_state_dict({"yielded": position.per_rank_start(world_size)})

    def rng_for(self, rank: int, world_size: int) -> Dict[str, Any]:
        """This rank's RNG states (``set_rng_state``'s form): its own if the world size is the saved one, else
        rank 0's."""
        states = self.rng_per_rank
        return native_rng_state(states[rank] if len(states) == world_size else states[0])


def _per_group(state: Dict[str, Any], num_groups: int) -> Dict[str, Any]:
    """An LR scheduler's state with its per-group lists (``base_lrs``, ``_last_lr``, LambdaLR's ``lr_lambdas``) fitted
    to ``num_groups`` groups by repeating the first entry."""
    saved = len(state.get("base_lrs", ()))
    if saved in (0, num_groups):
        return state
    per_group = ("base_lrs", "_last_lr", "lr_lambdas")
    return {
        key: [value[0]] * num_groups if key in per_group and isinstance(value, list) and len(value) == saved else value
        for key, value in state.items()
    }


def _unpickling_reason(err: Exception) -> str:
    """The line of torch's weights-only error that says what failed (it is framed by advice)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith("Check the documentation")]
    return lines[-1][:200] if lines else type(err).__name__


def previous_path(path: PathLike) -> Path:
    """``recipe_state.pt`` -> ``recipe_state.prev.pt``: where the state before the newest is kept."""
    path = Path(path)
    return path.with_name(f"{path.stem}.prev{path.suffix}")


def _replace_with_copy(src: Path, dst: Path) -> None:
    """Makes ``dst`` a complete copy of ``src`` atomically (a hard link where the file system allows, else a
    copy), under a temporary name first."""
    tmp = dst.parent / f".{dst.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        try:
            os.link(src, tmp)
        except OSError:
            shutil.copy2(src, tmp)
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)
