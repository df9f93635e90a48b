"""The distkit Trainer: single device, ``nn.DataParallel``, DDP and FSDP, with AMP, accumulation,
callbacks, loggers, checkpoints and exact resume, built only from distkit's public helpers.

Example:
    >>> import distkit, torch
    >>> trainer = distkit.Trainer(strategy="ddp", devices=2, max_epochs=5)
    >>> trainer.fit(model, train_set, val_set, optimizer=torch.optim.Adam(model.parameters()),
    ...             loss_fn=torch.nn.functional.cross_entropy)  # doctest: +SKIP
"""

from distkit.trainer.callbacks import (
    Callback,
    EarlyStopping,
    LearningRateMonitor,
    ModelCheckpoint,
    ThroughputMonitor,
    TrainerView,
)
from distkit.trainer.loggers import CSVLogger, Logger, TensorBoardLogger
from distkit.trainer.metrics import accuracy
from distkit.trainer.profiler import TorchProfiler
from distkit.trainer.progress import ProgressLog
from distkit.trainer.schedules import warmup_schedule
from distkit.trainer.strategies import DDPStrategy, FSDPStrategy
from distkit.trainer.tracking import MLflowLogger, WandbLogger
from distkit.trainer.trainer import Trainer

__all__ = [
    "CSVLogger",
    "Callback",
    "DDPStrategy",
    "EarlyStopping",
    "FSDPStrategy",
    "LearningRateMonitor",
    "Logger",
    "MLflowLogger",
    "ModelCheckpoint",
    "ProgressLog",
    "TensorBoardLogger",
    "ThroughputMonitor",
    "TorchProfiler",
    "Trainer",
    "TrainerView",
    "WandbLogger",
    "accuracy",
    "warmup_schedule",
]
