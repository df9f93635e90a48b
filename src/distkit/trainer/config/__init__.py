"""TrainerCLI and what a run's configuration needs (private but for ``TrainerCLI``): the command line and
config files on jsonargparse (cli), how their YAML is read: a duplicate key or a ``${NAME}`` refused
(loader), the configuration saved with a run and checked on resume
(run_config), and the errors that name a careless config's slip and its fix (errors). The
public path ``distkit.trainer.config_cli`` re-exports ``TrainerCLI``."""
