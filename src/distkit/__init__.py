"""distkit: PyTorch training on many processes, correct by default and fast.

``import distkit`` is nearly free: every public name (and torch with it) loads on first use. It
probes no device, sets no environment variable and adds no log handler.

Example:
    >>> import distkit
    >>> env = distkit.init()
    >>> distkit.reduce_metrics({"loss": 0.5})
    {'loss': 0.5}
"""

from typing import TYPE_CHECKING

from distkit._version import __version__

if TYPE_CHECKING:  # what type checkers and IDEs see; _LAZY and _MODULES below are what runs
    from distkit import (
        bench as bench,
        checkpoint as checkpoint,
        cli as cli,
        collectives as collectives,
        coordination as coordination,
        data as data,
        env as env,
        errors as errors,
        monitor as monitor,
        optim as optim,
        runtime as runtime,
        seeding as seeding,
        sharding as sharding,
        storage as storage,
        stragglers as stragglers,
        testing as testing,
        trainer as trainer,
    )
    from distkit.bench import (
        profile_scaling as profile_scaling,
    )
    from distkit.checkpoint import (
        CheckpointConflictError as CheckpointConflictError,
        CheckpointCorruptError as CheckpointCorruptError,
        CheckpointManager as CheckpointManager,
        ForeignCheckpointError as ForeignCheckpointError,
        ImportReport as ImportReport,
        ResumeState as ResumeState,
        consolidate_checkpoint as consolidate_checkpoint,
        import_checkpoint as import_checkpoint,
        load_checkpoint as load_checkpoint,
        save_checkpoint as save_checkpoint,
    )
    from distkit.collectives import (
        MetricValue as MetricValue,
        all_gather as all_gather,
        all_gather_object as all_gather_object,
        all_ranks as all_ranks,
        all_reduce as all_reduce,
        any_rank as any_rank,
        broadcast_object as broadcast_object,
        reduce_metrics as reduce_metrics,
        scatter_object as scatter_object,
    )
    from distkit.coordination import (
        main_process_first as main_process_first,
        run_on_main as run_on_main,
    )
    from distkit.data import (
        DataLoaderProfile as DataLoaderProfile,
        DistributedLoader as DistributedLoader,
        DistributedSplitSampler as DistributedSplitSampler,
        ShardFiles as ShardFiles,
        StreamLoader as StreamLoader,
        distributed_dataloader as distributed_dataloader,
        distributed_sampler as distributed_sampler,
        gather_for_metrics as gather_for_metrics,
        profile_dataloader as profile_dataloader,
        split_between_processes as split_between_processes,
    )
    from distkit.env import (
        LaunchEnv as LaunchEnv,
        detect_env as detect_env,
        expand_slurm_nodelist as expand_slurm_nodelist,
    )
    from distkit.errors import (
        CollectiveMismatchError as CollectiveMismatchError,
        CollectiveTimeoutError as CollectiveTimeoutError,
        DistkitError as DistkitError,
        MainProcessError as MainProcessError,
    )
    from distkit.monitor import (
        GPUMonitor as GPUMonitor,
        ThroughputMeter as ThroughputMeter,
        memory_stats as memory_stats,
    )
    from distkit.optim import linear_warmup as linear_warmup, scale_lr as scale_lr
    from distkit.runtime import (
        DEFAULT_TIMEOUT_S as DEFAULT_TIMEOUT_S,
        HANG_EXIT_CODE as HANG_EXIT_CODE,
        PEER_FAILED_EXIT_CODE as PEER_FAILED_EXIT_CODE,
        RankLoggerAdapter as RankLoggerAdapter,
        barrier as barrier,
        get_device as get_device,
        get_env as get_env,
        get_local_rank as get_local_rank,
        get_local_world_size as get_local_world_size,
        get_logger as get_logger,
        get_node_rank as get_node_rank,
        get_rank as get_rank,
        get_world_size as get_world_size,
        init as init,
        is_distributed as is_distributed,
        is_initialized as is_initialized,
        is_local_main_process as is_local_main_process,
        is_main_process as is_main_process,
        local_main_process_only as local_main_process_only,
        main_process_only as main_process_only,
        rank_zero_print as rank_zero_print,
        shutdown as shutdown,
    )
    from distkit.seeding import (
        capture_rng_state as capture_rng_state,
        derive_seed as derive_seed,
        restore_rng_state as restore_rng_state,
        seed_everything as seed_everything,
        seed_worker as seed_worker,
    )
    from distkit.sharding import shard_model as shard_model, sync_buffers as sync_buffers
    from distkit.storage import (
        ChecksumMismatchError as ChecksumMismatchError,
        LockTimeoutError as LockTimeoutError,
        UploadHandle as UploadHandle,
        download as download,
        upload as upload,
    )
    from distkit.stragglers import (
        StepTimer as StepTimer,
        Straggler as Straggler,
        StragglerDetector as StragglerDetector,
    )
    from distkit.trainer import (
        Callback as Callback,
        CSVLogger as CSVLogger,
        DDPStrategy as DDPStrategy,
        EarlyStopping as EarlyStopping,
        FSDPStrategy as FSDPStrategy,
        LearningRateMonitor as LearningRateMonitor,
        Logger as Logger,
        MLflowLogger as MLflowLogger,
        ModelCheckpoint as ModelCheckpoint,
        ProgressLog as ProgressLog,
        TensorBoardLogger as TensorBoardLogger,
        ThroughputMonitor as ThroughputMonitor,
        TorchProfiler as TorchProfiler,
        Trainer as Trainer,
        TrainerView as TrainerView,
        WandbLogger as WandbLogger,
        accuracy as accuracy,
        warmup_schedule as warmup_schedule,
    )
    from distkit.trainer.config_cli import TrainerCLI as TrainerCLI


# Every public name loads on first use: `import distkit` itself imports nothing heavy (not even
# torch), so the pytest plugin that the distkit package registers costs other test suites nothing.
_LAZY: dict[str, str] = {
    # launcher environment, runtime and collectives
    "MetricValue": "distkit.collectives",
    "all_gather": "distkit.collectives",
    "all_gather_object": "distkit.collectives",
    "all_ranks": "distkit.collectives",
    "all_reduce": "distkit.collectives",
    "any_rank": "distkit.collectives",
    "broadcast_object": "distkit.collectives",
    "reduce_metrics": "distkit.collectives",
    "scatter_object": "distkit.collectives",
    "LaunchEnv": "distkit.env",
    "detect_env": "distkit.env",
    "expand_slurm_nodelist": "distkit.env",
    "CollectiveMismatchError": "distkit.errors",
    "CollectiveTimeoutError": "distkit.errors",
    "DistkitError": "distkit.errors",
    "MainProcessError": "distkit.errors",
    "DEFAULT_TIMEOUT_S": "distkit.runtime",
    "HANG_EXIT_CODE": "distkit.runtime",
    "PEER_FAILED_EXIT_CODE": "distkit.runtime",
    "RankLoggerAdapter": "distkit.runtime",
    "barrier": "distkit.runtime",
    "get_device": "distkit.runtime",
    "get_env": "distkit.runtime",
    "get_local_rank": "distkit.runtime",
    "get_local_world_size": "distkit.runtime",
    "get_logger": "distkit.runtime",
    "get_node_rank": "distkit.runtime",
    "get_rank": "distkit.runtime",
    "get_world_size": "distkit.runtime",
    "init": "distkit.runtime",
    "is_distributed": "distkit.runtime",
    "is_initialized": "distkit.runtime",
    "is_local_main_process": "distkit.runtime",
    "is_main_process": "distkit.runtime",
    "main_process_only": "distkit.runtime",
    "local_main_process_only": "distkit.runtime",
    "rank_zero_print": "distkit.runtime",
    "shutdown": "distkit.runtime",
    # coordination and storage
    "main_process_first": "distkit.coordination",
    "run_on_main": "distkit.coordination",
    "download": "distkit.storage",
    "upload": "distkit.storage",
    "UploadHandle": "distkit.storage",
    "ChecksumMismatchError": "distkit.storage",
    "LockTimeoutError": "distkit.storage",
    # checkpoints
    "save_checkpoint": "distkit.checkpoint",
    "load_checkpoint": "distkit.checkpoint",
    "consolidate_checkpoint": "distkit.checkpoint",
    "import_checkpoint": "distkit.checkpoint",
    "ImportReport": "distkit.checkpoint",
    "ForeignCheckpointError": "distkit.checkpoint",
    "CheckpointManager": "distkit.checkpoint",
    "CheckpointCorruptError": "distkit.checkpoint",
    "CheckpointConflictError": "distkit.checkpoint",
    "ResumeState": "distkit.checkpoint",
    # seeding and data
    "capture_rng_state": "distkit.seeding",
    "restore_rng_state": "distkit.seeding",
    "seed_everything": "distkit.seeding",
    "seed_worker": "distkit.seeding",
    "derive_seed": "distkit.seeding",
    "distributed_sampler": "distkit.data",
    "distributed_dataloader": "distkit.data",
    "gather_for_metrics": "distkit.data",
    "profile_dataloader": "distkit.data",
    "split_between_processes": "distkit.data",
    "scale_lr": "distkit.optim",
    "linear_warmup": "distkit.optim",
    "DistributedLoader": "distkit.data",
    "DistributedSplitSampler": "distkit.data",
    "DataLoaderProfile": "distkit.data",
    "ShardFiles": "distkit.data",
    "StreamLoader": "distkit.data",
    # monitoring and scaling
    "GPUMonitor": "distkit.monitor",
    "ThroughputMeter": "distkit.monitor",
    "memory_stats": "distkit.monitor",
    "StepTimer": "distkit.stragglers",
    "Straggler": "distkit.stragglers",
    "StragglerDetector": "distkit.stragglers",
    "profile_scaling": "distkit.bench",
    # trainer
    "Trainer": "distkit.trainer",
    "Callback": "distkit.trainer",
    "DDPStrategy": "distkit.trainer",
    "FSDPStrategy": "distkit.trainer",
    "TrainerView": "distkit.trainer",
    "shard_model": "distkit.sharding",
    "sync_buffers": "distkit.sharding",
    "ModelCheckpoint": "distkit.trainer",
    "ProgressLog": "distkit.trainer",
    "TorchProfiler": "distkit.trainer",
    "EarlyStopping": "distkit.trainer",
    "LearningRateMonitor": "distkit.trainer",
    "ThroughputMonitor": "distkit.trainer",
    "Logger": "distkit.trainer",
    "CSVLogger": "distkit.trainer",
    "TensorBoardLogger": "distkit.trainer",
    "MLflowLogger": "distkit.trainer",
    "WandbLogger": "distkit.trainer",
    "accuracy": "distkit.trainer",
    "warmup_schedule": "distkit.trainer",
    "TrainerCLI": "distkit.trainer.config_cli",
}


# The public modules: `distkit.trainer.accuracy` and `distkit.testing.run_ranks` after a plain
# `import distkit` (docs name them so), loaded on first use too.
_MODULES = frozenset(
    {
        "bench",
        "checkpoint",
        "cli",
        "collectives",
        "coordination",
        "data",
        "env",
        "errors",
        "monitor",
        "optim",
        "runtime",
        "seeding",
        "sharding",
        "storage",
        "stragglers",
        "testing",
        "trainer",
    }
)


def __getattr__(name: str) -> object:
    import importlib

    if name in _MODULES:
        return importlib.import_module(f".{name}", __name__)  # which sets it on this package
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'distkit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = ["__version__", *_LAZY]
