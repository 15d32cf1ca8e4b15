"""The validation losses of a run, for the console (as they come) and the end-of-run summary."""

from __future__ import annotations

from typing import List, Tuple

from tqdm import tqdm


class ValidationHistory:
    """Validation losses by step: each printed as it comes (above the progress bar), the first and last (and the
    best) in the summary."""

    def __init__(self):
        self.losses: List[Tuple[int, float]] = []

    def add(self, step: int, loss: float) -> None:
        """Records and prints one validation loss.

        Args:
            step (int): the global step.
            loss (float): the validation loss.
        """
        self.losses.append((step, loss))
        tqdm.write(f"Step {step}: validation loss {loss:.4f}")

    def summary_lines(self) -> List[str]:
        """
        Returns:
            List[str]: the summary's validation line (none without validation in this run).
        """
        if not self.losses:
            return []
        (first_step, first), (last_step, last) = self.losses[0], self.losses[-1]
        best_step, best = min(self.losses, key=lambda item: item[1])
        return [
            f"  validation loss:     {first:.4f} (step {first_step}) -> {last:.4f} (step {last_step}); best "
            f"{best:.4f} (step {best_step})"
        ]
