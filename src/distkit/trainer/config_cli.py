"""``TrainerCLI`` at its documented import path; the code is in :mod:`distkit.trainer.config.cli`."""

from distkit.trainer.config.cli import TrainerCLI

__all__ = ["TrainerCLI"]
