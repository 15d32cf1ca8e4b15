"""The end of a run: the summary it prints (loss, validation, peak memory, throughput, where the outputs are) and the
commands that use what it trained."""

from pathlib import Path
from typing import Any, Dict, List, Optional

from torchtune_ext._shipped import generation_config_for
from torchtune_ext.training._export import merge_command
from torchtune_ext.training._interrupt import launch_command
from torchtune_ext.training._nonfinite import NonFiniteGuard
from torchtune_ext.training._validation import ValidationHistory


def run_summary(
    *,
    world_size: int,
    losses: List[float],
    first_step: int,
    last_step: int,
    validation: ValidationHistory,
    memory: Dict[str, float],
    guard: NonFiniteGuard,
    train_tokens: float,
    train_seconds: float,
    checkpoint: Optional[Path],
    merged_note: Optional[str],
    output_dir: Path,
    base_dir: Path,
    log_dir: Optional[Any],
    continue_command: Optional[str] = None,
) -> str:
    """What a finished run prints last (rank 0).

    Args:
        world_size (int): the number of ranks.
        losses (List[float]): this run's loss per step.
        first_step (int): this run's first step (a resumed run's is after the saved one).
        last_step (int): the last step.
        validation (ValidationHistory): the validation losses.
        memory (Dict[str, float]): the memory figures (``name`` or ``name/rank<r>``), in GiB.
        guard (NonFiniteGuard): the run's non-finite guard (fp16 skipped steps).
        train_tokens (float): label tokens trained, all ranks.
        train_seconds (float): seconds in training steps.
        checkpoint (Optional[Path]): the last step folder saved (None: none).
        merged_note (Optional[str]): why the merged model was skipped, if it was.
        output_dir (Path): the run's output folder.
        base_dir (Path): the base checkpoint's folder.
        log_dir (Optional[Any]): the metric logger's folder, if it has one.
        continue_command (Optional[str]): the command that trains on to the end, where ``stop_after_step`` ended
            the run early.

    Returns:
        str: the lines.
    """
    lines = ["", "Done." if world_size == 1 else f"Done ({world_size} ranks)."]
    if losses:
        lines.append(f"  loss: {losses[0]:.4f} (step {first_step}) -> {losses[-1]:.4f} (step {last_step})")
    lines += validation.summary_lines()
    lines.append(f"  peak memory:         {peak_memory_line(memory)}")
    lines += guard.summary()  # fp16: skipped steps
    if train_seconds > 0:
        lines.append(
            f"  tokens/s (mean):     {train_tokens / train_seconds:,.0f} label tokens/s over "
            f"{last_step - first_step + 1} steps" + (f" ({world_size} ranks together)" if world_size > 1 else "")
        )
    if checkpoint is not None:
        lines.append(f"  adapter (PEFT):      {checkpoint / 'adapter'}")
        if (checkpoint / "merged").is_dir():
            lines.append(f"  merged model (HF):   {checkpoint / 'merged'}")
        elif merged_note:
            lines.append(f"  merged model:        skipped: {merged_note}")
    if (output_dir / "recipe_state").is_dir():
        lines.append(f"  resumable state:     {output_dir / 'recipe_state'}")
    if log_dir is not None:
        lines.append(f"  TensorBoard logs:    {log_dir}  (tensorboard --logdir {log_dir})")
    if checkpoint is not None:
        lines += next_steps(base_dir, checkpoint, continue_command, generation_config_of_this_run())
    return "\n".join(lines)


def next_steps(
    base_dir: Path,
    checkpoint: Path,
    continue_command: Optional[str] = None,
    generation_config: Optional[str] = None,
) -> List[str]:
    """What a user does with a finished run, as commands (``base_dir``: the base checkpoint; ``checkpoint``: the last
    step folder; ``continue_command``: the command that trains on, where ``stop_after_step`` ended the run early;
    ``generation_config``: the shipped generation config for the model, where known)."""
    answer = f"  answer prompts:      tune-ext generate --config {generation_config or '<model>/<size>_generation'} "
    answer += f'checkpointer.checkpoint_dir={base_dir} adapter_dir={checkpoint / "adapter"} prompt="..."'
    lines = ["Next:", answer + ("" if generation_config else " (`tune-ext ls` lists the generation configs)")]
    if not (checkpoint / "merged").is_dir():
        lines.append(f"  merge it:            {merge_command(base_dir, checkpoint)}")
    if continue_command is not None:
        lines.append(f"  continue training:   {continue_command}")
    else:
        lines.append("  train further:       the same command with resume_from_checkpoint=True and a larger epochs")
    return lines


def generation_config_of_this_run() -> Optional[str]:
    """The shipped generation config for the model this run's ``--config`` trains, where one ships."""
    argv = launch_command()
    if "--config" not in argv[:-1]:
        return None
    return generation_config_for(argv[argv.index("--config") + 1])


def _max_over_ranks(memory: Dict[str, float]) -> Dict[str, float]:
    """The largest value of each memory figure over the ranks (``name`` or ``name/rank<r>`` keys)."""
    peaks: Dict[str, float] = {}
    for key, value in memory.items():
        name = key.split("/")[0]
        peaks[name] = max(peaks.get(name, 0.0), value)
    return peaks


def progress_note(metrics: Dict[str, float]) -> str:
    """What the progress bar shows after a logged step: tokens/s (all ranks) and the peak memory that bounds the run
    (the device's allocated peak on CUDA, else the host's RSS), max over ranks, e.g. `` | 1,739 tok/s | 2.13 GiB``."""
    peaks = _max_over_ranks(metrics)
    memory = peaks.get("peak_memory_alloc", peaks.get("peak_rss"))
    note = f" | {metrics['tokens_per_second']:,.0f} tok/s"
    return note + (f" | {memory:.2f} GiB" if memory is not None else "")


def peak_memory_line(memory: Dict[str, float]) -> str:
    """The largest value of each memory figure over the ranks (``name`` or ``name/rank<r>`` keys), in GiB."""
    peaks = _max_over_ranks(memory)
    parts = []
    if "peak_memory_alloc" in peaks:
        parts.append(
            f"{peaks['peak_memory_alloc']:.2f} GiB allocated, {peaks['peak_memory_reserved']:.2f} GiB reserved"
        )
    parts.append(f"{peaks['peak_rss']:.2f} GiB host RSS")
    return " | ".join(parts) + (" (max over ranks)" if any("/" in key for key in memory) else "")
