"""distkit: PyTorch training on many processes, correct by default and fast.

``import distkit`` is nearly free: every public name (and torch with it) loads on first use. It
probes no device, sets no environment variable and adds no log handler.

Example:
    >>> import distkit
    >>> env = distkit.init()
    >>> distkit.reduce_metrics({"loss": 0.5})
    {'loss': 0.5}
"""

__version__ = "0.1.0"

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
    "LaunchEnv": "distkit.env",
    "detect_env": "distkit.env",
    "expand_slurm_nodelist": "distkit.env",
    "CollectiveTimeoutError": "distkit.errors",
    "DistkitError": "distkit.errors",
    "MainProcessError": "distkit.errors",
    "DEFAULT_TIMEOUT_S": "distkit.runtime",
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
    "CheckpointManager": "distkit.checkpoint",
    "CheckpointCorruptError": "distkit.checkpoint",
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
    "scale_lr": "distkit.data",
    "linear_warmup": "distkit.data",
    "DistributedLoader": "distkit.data",
    "DistributedSplitSampler": "distkit.data",
    "DataLoaderProfile": "distkit.data",
    # monitoring and scaling
    "GPUMonitor": "distkit.monitor",
    "ThroughputMeter": "distkit.monitor",
    "memory_stats": "distkit.monitor",
    "profile_scaling": "distkit.bench",
    # trainer
    "Trainer": "distkit.trainer",
    "Callback": "distkit.trainer",
    "DDPStrategy": "distkit.trainer",
    "ModelCheckpoint": "distkit.trainer",
    "EarlyStopping": "distkit.trainer",
    "LearningRateMonitor": "distkit.trainer",
    "ThroughputMonitor": "distkit.trainer",
    "Logger": "distkit.trainer",
    "CSVLogger": "distkit.trainer",
    "TensorBoardLogger": "distkit.trainer",
    "accuracy": "distkit.trainer",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'distkit' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = ["__version__", *_LAZY]
