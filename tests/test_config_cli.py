"""TrainerCLI: config files, overrides, --print_config, --help, errors, and the config that travels
with the run (saved once by the main process, logged as hparams, checked on resume and across ranks)."""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn
from torch.utils.data import TensorDataset

import distkit
from distkit.errors import DistkitError
from distkit.trainer import Trainer
from distkit.trainer.config import run_config as _run_config
from distkit.trainer.config_cli import TrainerCLI


class TinyNet(nn.Module):
    """A two-layer network for 4 features and 2 classes.

    Args:
        hidden: Width of the hidden layer.
        dropout: Dropout probability after it.
    """

    def __init__(self, hidden: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def blobs(samples: int = 64, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """Two separable classes of points.

    Args:
        samples: Training samples.
        seed: Seed of the generator.
    """
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 4, generator=generator)
    y = (x[:, 0] > 0).long()
    return TensorDataset(x, y), TensorDataset(x[:16], y[:16])


QUIET = {"enable_progress_bar": False, "max_epochs": 1, "batch_size": 16}


def make_cli(
    args: list[str], *, run: bool = False, trainer_defaults: dict[str, object] = QUIET, **kwargs: object
) -> TrainerCLI:
    return TrainerCLI(
        TinyNet,
        blobs,
        loss_fn=nn.functional.cross_entropy,
        trainer_defaults=trainer_defaults,
        args=args,
        run=run,
        **kwargs,  # type: ignore[arg-type]
    )


def write_yaml(path: Path, data: dict[str, object]) -> str:
    path.write_text(yaml.safe_dump(data))
    return str(path)


# --------------------------------------------------------------------------------------------------
# Parsing


def test_config_files_merge_in_order_and_command_line_overrides_win(tmp_path: Path) -> None:
    first = write_yaml(
        tmp_path / "a.yaml",
        {"model": {"hidden": 8, "dropout": 0.5}, "trainer": {"max_epochs": 3, "batch_size": 4}},
    )
    second = write_yaml(tmp_path / "b.yaml", {"model": {"hidden": 16}, "trainer": {"max_epochs": 7}})
    cli = make_cli(["--config", first, "-c", second, "--trainer.max_epochs", "9", "--optimizer.lr", "0.5"])
    assert cli.config.model.hidden == 16  # the later file wins
    assert cli.config.model.dropout == 0.5  # what only the first file set stays
    assert cli.trainer.max_epochs == 9  # the command line after the files wins
    assert cli.trainer.batch_size == 4
    assert cli.model.net[0].out_features == 16
    optimizer = cli.optimizer(cli.model.parameters())
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["lr"] == 0.5
    assert cli.run_config["model"] == {"hidden": 16, "dropout": 0.5}
    assert cli.run_config["trainer"]["max_epochs"] == 9
    assert "config" not in cli.run_config
    assert cli.trainer.run_config == cli.run_config  # type: ignore[attr-defined]


def test_optimizer_and_scheduler_are_chosen_by_class_path_with_init_args(tmp_path: Path) -> None:
    config = write_yaml(
        tmp_path / "opt.yaml",
        {
            "model": {"hidden": 4},
            "optimizer": {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.25, "momentum": 0.9}},
            "lr_scheduler": {"class_path": "torch.optim.lr_scheduler.StepLR", "init_args": {"step_size": 3}},
            "scheduler_interval": "epoch",
        },
    )
    cli = make_cli(["--config", config])
    optimizer = cli.optimizer(cli.model.parameters())
    assert type(optimizer) is torch.optim.SGD
    assert optimizer.defaults["lr"] == 0.25 and optimizer.defaults["momentum"] == 0.9
    assert cli.lr_scheduler is not None
    scheduler = cli.lr_scheduler(optimizer)
    assert type(scheduler) is torch.optim.lr_scheduler.StepLR and scheduler.step_size == 3
    assert cli.scheduler_interval == "epoch"


def test_a_class_change_that_keeps_the_default_classs_default_is_warned_about(tmp_path: Path) -> None:
    """AdamW (the default) has weight_decay=0.01, SGD 0: `optimizer: {class_path: SGD}` trains with
    0.01, as jsonargparse keeps the values both classes name. Was: without a word."""
    only_class = write_yaml(
        tmp_path / "sgd.yaml", {"model": {"hidden": 4}, "optimizer": {"class_path": "SGD"}}
    )
    with pytest.warns(
        UserWarning, match=r"optimizer is SGD, but weight_decay=0\.01 \(SGD's default: 0\) kept AdamW's"
    ):
        cli = make_cli(["--config", only_class])
    assert cli.optimizer(cli.model.parameters()).defaults["weight_decay"] == 0.01  # documented: kept
    chosen = write_yaml(
        tmp_path / "sgd0.yaml",
        {"model": {"hidden": 4}, "optimizer": {"class_path": "SGD", "init_args": {"weight_decay": 0.0}}},
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cli = make_cli(["--config", chosen])
    assert cli.optimizer(cli.model.parameters()).defaults["weight_decay"] == 0.0


def test_default_optimizer_may_be_a_partial_and_the_command_line_changes_its_class() -> None:
    import functools

    default = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.5)
    cli = make_cli(["--model.hidden", "4"], optimizer=default)
    assert cli.run_config["optimizer"]["class_path"] == "torch.optim.SGD"
    assert cli.run_config["optimizer"]["init_args"]["momentum"] == 0.5
    cli = make_cli(
        ["--model.hidden", "4", "--optimizer", "Adam", "--optimizer.lr", "0.01"], optimizer=default
    )
    assert type(cli.optimizer(cli.model.parameters())) is torch.optim.Adam


def test_print_config_prints_the_resolved_yaml_and_exits_before_building(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_yaml(tmp_path / "run.yaml", {"model": {"hidden": 8}, "trainer": {"max_epochs": 3}})
    root = tmp_path / "never"
    with pytest.raises(SystemExit) as exit_info:
        make_cli(
            [
                "--config",
                config,
                "--model.hidden",
                "32",
                f"--trainer.default_root_dir={root}",
                "--print_config",
            ],
            run=True,
        )
    assert exit_info.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"] == {"hidden": 32, "dropout": 0.0}
    assert printed["trainer"]["max_epochs"] == 3
    assert printed["trainer"]["batch_size"] == 16  # the script's trainer_defaults
    assert printed["optimizer"]["class_path"] == "torch.optim.AdamW"
    assert not root.exists()  # nothing was built or trained


def test_print_config_prints_on_rank_0_only_under_a_launcher(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    launcher = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}
    for name, value in {**launcher, "RANK": "1", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit):
        make_cli(["--model.hidden", "8", "--print_config"])
    assert capsys.readouterr().out == ""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(SystemExit):
        make_cli(["--model.hidden", "8", "--print_config"])
    assert yaml.safe_load(capsys.readouterr().out)["model"]["hidden"] == 8


def test_help_lists_every_option_with_type_default_and_docstring(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # one line per option description: no wrapping to search across
    with pytest.raises(SystemExit) as exit_info:
        make_cli(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for name in inspect.signature(Trainer.__init__).parameters:
        if name not in ("self", "run_config", "config"):
            assert f"--trainer.{name} " in text, name
    for option in ("--model.hidden", "--model.dropout", "--data.samples", "--data.seed", "--optimizer"):
        assert option in text
    assert "--lr_scheduler" in text and "--scheduler_interval" in text and "--print_config" in text
    assert "Width of the hidden layer. (required, type: int)" in text  # the model's docstring
    assert "Epochs to train" in text and "(type: int | null, default: null)" in text  # the Trainer's
    assert "Samples per batch on each rank" in text and "(type: int, default: 16)" in text  # a default
    assert "Training samples. (type: int, default: 64)" in text  # the data function's


# --------------------------------------------------------------------------------------------------
# Errors: the key, the value, the expected type


@pytest.mark.parametrize(
    ("args", "config", "expected"),
    [
        (
            ["--model.hidden", "4", "--model.hiden", "8"],
            None,
            [
                "unknown key model.hiden",
                "'8'",
                "Did you mean model.hidden?",
                "model accepts: dropout, hidden",
            ],
        ),
        (
            ["--model.hidden", "4"],
            {"trainer": {"max_epoch": 5}},
            ["unknown key trainer.max_epoch", "(given 5)", "Did you mean trainer.max_epochs?", "bad.yaml"],
        ),
        (
            ["--model.hidden", "4", "--optimizer.lrr", "0.1"],
            None,
            ["unknown key optimizer.lrr", "'0.1'", "Did you mean optimizer.lr?", "weight_decay"],
        ),
        (
            ["--model.hidden", "four"],
            None,
            ["model.hidden: expected int, got 'four'", "--model.hidden VALUE"],
        ),
        (
            ["--model.hidden", "4"],
            {"trainer": {"max_epochs": "many"}},
            ["trainer.max_epochs: expected int | None, got 'many'"],
        ),
        (
            ["--model.hidden", "4", "--optimizer.lr", "fast"],
            None,
            ["optimizer.lr: expected float", "got 'fast'"],
        ),
        # A file's value is checked as the file is read: the file is named, even when the command
        # line gives the key too (was: "Set it on the command line ... or in a --config file").
        (
            ["--model.hidden", "4"],
            {"optimizer": {"class_path": "torch.optim.SGD", "init_args": {"lr": "fast"}}},
            ["optimizer.lr: expected float", "got 'fast'. Fix optimizer.lr in", "bad.yaml. --help"],
        ),
        (
            ["--model.hidden", "4", "--trainer.max_epochs", "3"],
            {"trainer": {"max_epochs": "many"}},
            [
                "got 'many'. Fix trainer.max_epochs in",
                "bad.yaml: a --config file's values are checked as the file is read, so another value "
                "given for it elsewhere does not mend this one.",
            ],
        ),
        (
            ["--model.hidden", "4", "--optimizer", "torch.optim.SGD"],
            {"optimizer": {"class_path": "torch.optimm.SGD", "init_args": {"lr": 0.1}}},
            ["Did you mean torch.optim.SGD? Fix optimizer in", "bad.yaml: a --config file's values"],
        ),
        (
            [],
            None,
            ["missing required value model.hidden (type int, no default)", "--model.hidden VALUE"],
        ),
        # One-character slips in a class path: the class meant is named.
        (
            ["--model.hidden", "4", "--optimizer", "torch.optim.Adamw"],
            None,
            [
                "optimizer: torch.optim.Adamw names no class (module torch.optim has no attribute 'Adamw')",
                "Did you mean torch.optim.AdamW?",
                "Set optimizer on the command line (--optimizer CLASS)",
            ],
        ),
        (
            ["--model.hidden", "4", "--lr_scheduler", "StepLr"],
            None,
            [
                "lr_scheduler: StepLr names no class (no subclass of torch.optim.lr_scheduler.LRScheduler "
                "is named 'StepLr')",
                "Did you mean torch.optim.lr_scheduler.StepLR?",
            ],
        ),
        (
            ["--model.hidden", "4"],
            {"optimizer": {"class_path": "torch.optimm.SGD", "init_args": {"lr": 0.1}}},
            [
                "optimizer: torch.optimm.SGD names no class (module torch has no attribute 'optimm')",
                "Did you mean torch.optim.SGD?",
                "Fix optimizer in",
                "bad.yaml",
            ],
        ),
        (
            ["--model.hidden", "4", "--trainer.callbacks+=EarlyStoping"],
            None,
            ["trainer.callbacks: EarlyStoping names no class", "Did you mean distkit.EarlyStopping?"],
        ),
        # A slip in the init args of a class inside trainer.* (was: "Did you mean" the slip itself,
        # "in a config file", and the top-level keys).
        (
            ["--model.hidden", "4"],
            {
                "trainer": {
                    "callbacks": [
                        {"class_path": "distkit.trainer.EarlyStopping", "init_args": {"monitr": "val_loss"}}
                    ]
                }
            },
            [
                "unknown key trainer.callbacks.monitr in",
                "bad.yaml (given 'val_loss')",
                "Did you mean trainer.callbacks.monitor?",
                "accepts: monitor, mode, patience",
            ],
        ),
        (
            ["--model.hidden", "4", "--trainer.logger", "CSVLogger", "--trainer.logger.save_dr", "logs"],
            None,
            [
                "unknown key trainer.logger.save_dr on the command line (given 'logs')",
                "Did you mean trainer.logger.save_dir?",
            ],
        ),
        # Values the Trainer refuses: the key, where it was given, the fix; no traceback.
        (
            ["--model.hidden", "4", "--trainer.strategy", "dpp"],
            None,
            ["trainer.strategy: strategy must be one of", "got 'dpp'", "--trainer.strategy VALUE"],
        ),
        (
            ["--model.hidden", "4"],
            {"trainer": {"max_epochs": 0}},
            ["trainer.max_epochs: max_epochs must be >= 1, got 0.", "Fix trainer.max_epochs in", "bad.yaml"],
        ),
        # Slips past the first name, and a known key with one dash (was: "Did you mean" the slip).
        (
            ["--model.hidden", "4"],
            {"optimizer": {"class_path": "torch.optim.AdamW", "init_arg": {"lr": 0.1}}},
            ["unknown key optimizer.init_arg.lr", "Did you mean optimizer.init_args.lr?"],
        ),
        (
            ["--model.hidden", "4", "-trainer.max_epochs", "2"],
            None,
            ["It is a known key: write the option with two dashes, --trainer.max_epochs."],
        ),
        (
            ["--model.hidden", "4", "--trainer..max_epochs", "2"],
            None,
            ["unknown key trainer..max_epochs", "Did you mean trainer.max_epochs?"],
        ),
        # A list where the names go: was dropped without a word under a later --model.hidden (and an
        # init_args list was a jsonargparse traceback).
        (
            ["--model.hidden", "16"],
            {"model": [32, 0.9]},
            ["model in ", "bad.yaml is a list ([32, 0.9]), not a mapping of argument names to values"],
        ),
        (
            ["--model.hidden", "4"],
            {"optimizer": {"class_path": "torch.optim.AdamW", "init_args": [0.1]}},
            ["optimizer.init_args in ", "bad.yaml is a list ([0.1]), not a mapping"],
        ),
        # A list quoted whole (was: "(given '[0.9')", cut at its first comma).
        (
            ["--model.hidden", "4"],
            {"optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"betaz": [0.9, 0.999]}}},
            [
                "unknown key optimizer.betaz in",
                "bad.yaml (given [0.9, 0.999])",
                "Did you mean optimizer.betas?",
            ],
        ),
        (
            ["--model.hidden", "4", "--optimizer.betaz=[0.9, 0.999]"],
            None,
            ["unknown key optimizer.betaz on the command line (given '[0.9, 0.999]')"],
        ),
        (
            ["--model.hidden", "4", "--optimizer", "{class_path: AdamW, init_args: {betaz: [0.9, 0.999]}}"],
            None,
            ["unknown key optimizer.betaz (given '[0.9, 0.999]')"],
        ),
        (
            ["--model.hidden", "4", "--modle.hidden=[8, 16]"],
            None,
            ["unknown key modle.hidden on the command line (given '[8, 16]')"],
        ),
        # Unquoted, the shell split it (was: "expected tuple, got '[0.9,'").
        (
            ["--model.hidden", "4", "--optimizer.betas", "[0.9,", "0.999]"],
            None,
            [
                "--optimizer.betas: the shell split the value '[0.9, 0.999]' at its spaces",
                "got '[0.9,'",
                "Quote the value whole: --optimizer.betas '[0.9, 0.999]'",
            ],
        ),
        # The expected type alone (was: "expected tuple with 2 elements. Got value, got ...").
        (
            ["--model.hidden", "4"],
            {"optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"betas": [0.9, 0.999, 0.5]}}},
            ["optimizer.betas: expected tuple with 2 elements, got '[0.9, 0.999, 0.5]'."],
        ),
    ],
    ids=[
        "unknown-cli",
        "unknown-in-file",
        "unknown-init-arg",
        "wrong-type-cli",
        "wrong-type-in-file",
        "wrong-type-init-arg",
        "wrong-type-init-arg-in-file",
        "wrong-type-in-file-beside-the-cli",
        "class-typo-in-file-beside-the-cli",
        "missing",
        "class-typo-cli",
        "class-name-typo",
        "class-module-typo-in-file",
        "callback-typo",
        "callback-init-arg-typo-in-file",
        "logger-init-arg-typo-cli",
        "trainer-refuses-cli",
        "trainer-refuses-in-file",
        "init-arg-slip-in-file",
        "one-dash",
        "two-dots",
        "model-as-a-list",
        "init-args-as-a-list",
        "list-value-of-an-unknown-key-in-file",
        "list-value-of-an-unknown-key-cli",
        "list-value-of-an-unknown-key-in-a-value",
        "list-value-of-an-unknown-top-level-key",
        "list-split-by-the-shell",
        "tuple-of-the-wrong-length-in-file",
    ],
)
def test_bad_input_names_the_key_the_value_and_what_was_expected(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    config: dict[str, object] | None,
    expected: list[str],
) -> None:
    if config is not None:
        args = [*args, "--config", write_yaml(tmp_path / "bad.yaml", config)]
    with pytest.raises(SystemExit) as exit_info:
        make_cli(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "error: " in err and "Traceback" not in err
    for part in expected:
        assert part in err, (part, err)


def test_a_section_given_something_else_than_its_arguments_names_the_value_and_what_belongs_there(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    # Was: "data.data: expected a value of another type, got the value given."
    err = cli_error(["--model.hidden", "4", "--data", "hello"], capsys)
    assert "data on the command line is 'hello', not a mapping of argument names" in err, err
    assert "(no file 'hello' exists)" in err and "--data.samples VALUE" in err
    assert "--data '{samples: ..., seed: ...}'" in err and "data accepts: samples (int), seed (int)." in err
    assert "data.data" not in err and "the value given" not in err
    Path("data.yaml").write_text('model: {hidden: 4}\ndata: "hello"\n')
    err = cli_error(["--config", "data.yaml"], capsys)
    assert "data in data.yaml is a str ('hello'), not a mapping of argument names to values" in err, err
    assert "data: {samples: ..., seed: ...}. data accepts: samples (int), seed (int)." in err
    # Was: "invalid trainer options: vars() argument must have __dict__ attribute".
    Path("trainer.yaml").write_text("model: {hidden: 4}\ntrainer: [1, 2]\n")
    err = cli_error(["--config", "trainer.yaml"], capsys)
    assert "trainer in trainer.yaml is a list ([1, 2]), not a mapping" in err, err
    assert "trainer accepts: strategy (" in err and "more (--help lists them)." in err
    # The path of the section's own file belongs there (was refused for model: and data:).
    Path("model.yaml").write_text("hidden: 32\ndropout: 0.5\n")
    Path("run.yaml").write_text("model: model.yaml\n")
    cli = make_cli(["--config", "run.yaml", "--model.dropout", "0.25"])
    assert cli.run_config["model"] == {"hidden": 32, "dropout": 0.25}


def test_a_long_value_in_a_message_is_cut_with_an_ellipsis(capsys: pytest.CaptureFixture[str]) -> None:
    value = "[" + ", ".join(str(i) for i in range(400)) + "]"
    err = cli_error(["--model.hidden", "4", f"--optimizer.betaz={value}"], capsys)
    given = err.split("(given ", 1)[1].split("). Did you mean", 1)[0]
    assert given.startswith("'[0, 1, 2, ") and given.endswith("...") and len(given) == 200, given


def test_a_config_file_that_is_missing_or_not_yaml_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: [\n")
    # An empty file or one of comments only was jsonargparse's "Unexpected config: # ...".
    empty, comments = tmp_path / "empty.yaml", tmp_path / "comments.yaml"
    empty.write_text("")
    comments.write_text("# trainer:\n#   max_epochs: 3\n")
    cases = [(tmp_path / "nope.yaml", "No such file"), (broken, "not valid YAML")]
    cases += [(path, "holds no settings (it is empty, or only comments)") for path in (empty, comments)]
    for path, expected in cases:
        with pytest.raises(SystemExit) as exit_info:
            make_cli(["--model.hidden", "4", "--config", str(path)])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert str(path) in err and expected in err and "Unexpected config" not in err, err


def test_a_duplicate_key_in_any_config_file_is_refused_naming_the_file_the_key_and_both_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Was: accepted without a word, the last value winning (max_epochs 5, a model without hidden 8).
    monkeypatch.chdir(tmp_path)
    Path("run.yaml").write_text("trainer:\n  max_epochs: 3\n  max_epochs: 5\n")
    Path("two_models.yaml").write_text("model:\n  hidden: 8\ntrainer: {}\nmodel:\n  dropout: 0.5\n")
    Path("data.yaml").write_text("samples: 32\nseed: 1\nsamples: 48\n")
    Path("trainer.yaml").write_text("batch_size: 4\n\nbatch_size: 8\n")
    Path("names_a_file.yaml").write_text("trainer: trainer.yaml\n")
    cases = [
        (["--config", "run.yaml"], "duplicate key trainer.max_epochs in run.yaml (lines 2 and 3)"),
        (["--config", "two_models.yaml"], "duplicate key model in two_models.yaml (lines 1 and 4)"),
        (["--data", "data.yaml"], "duplicate key data.samples in data.yaml (lines 1 and 3)"),
        (["--config", "names_a_file.yaml"], "key trainer.batch_size in trainer.yaml (lines 1 and 3)"),
        (
            ["--trainer", "{batch_size: 4, batch_size: 8}"],
            "key trainer.batch_size in a value on the command line",
        ),
        (
            ["--optimizer", "{class_path: torch.optim.SGD, init_args: {lr: 0.1, lr: 0.2}}"],
            "key optimizer.init_args.lr in a value on the command line",
        ),
    ]
    for args, expected in cases:
        err = cli_error(["--model.hidden", "4", *args], capsys)
        assert expected in err and "YAML would keep the last" in err, err
    assert "Merge the two model: sections into one" in cli_error(["--config", "two_models.yaml"], capsys)


def cli_error(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The message of a configuration error: exit code 2, no traceback."""
    with pytest.raises(SystemExit) as exit_info:
        make_cli(args, run=True)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "error: " in err and "Traceback" not in err, err
    return err


def test_a_variable_in_a_config_value_is_refused_naming_the_key_the_file_and_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Was: taken as it is, a run directory literally named ${SCRATCH} made in the working directory.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SCRATCH", str(tmp_path / "scratch"))
    Path("run.yaml").write_text("model:\n  hidden: 4\ntrainer:\n  default_root_dir: ${SCRATCH}/runs\n")
    err = cli_error(["--config", "run.yaml"], capsys)
    assert "trainer.default_root_dir in run.yaml (line 4) is '${SCRATCH}/runs'" in err, err
    assert "is not expanded" in err and "Write the value out" in err
    assert 'where the shell expands it: --trainer.default_root_dir "$SCRATCH/runs"' in err
    assert not (tmp_path / "${SCRATCH}").exists()
    # In an optimizer's init args, and in a value on the command line (the shell left it alone).
    Path("opt.yaml").write_text("optimizer:\n  class_path: SGD\n  init_args:\n    lr: ${LR}\n")
    err = cli_error(["--model.hidden", "4", "--config", "opt.yaml"], capsys)
    assert "optimizer.init_args.lr in opt.yaml (line 4)" in err and '--optimizer.lr "$LR"' in err, err
    err = cli_error(["--model.hidden", "4", "--trainer.default_root_dir", "${SCRATCH}/runs"], capsys)
    assert "--trainer.default_root_dir is '${SCRATCH}/runs' on the command line" in err, err
    assert 'in double quotes: --trainer.default_root_dir "$SCRATCH/runs"' in err
    assert not (tmp_path / "${SCRATCH}").exists()
    # Expanded by the shell, it runs.
    Path("run.yaml").write_text("model:\n  hidden: 4\n")
    cli = make_cli(["--config", "run.yaml", "--trainer.default_root_dir", f"{tmp_path}/scratch/runs"])
    assert str(cli.trainer.default_root_dir) == f"{tmp_path}/scratch/runs"


# --------------------------------------------------------------------------------------------------
# The config travels with the run


def run_args(root: Path, *extra: str) -> list[str]:
    return [f"--trainer.default_root_dir={root}", "--model.hidden", "4", *extra]


def test_fit_saves_the_resolved_config_and_hparams_is_the_full_config(tmp_path: Path) -> None:
    cli = make_cli(run_args(tmp_path, "--trainer.seed", "3"), run=True)
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved == cli.run_config
    assert set(saved) >= {"model", "data", "optimizer", "lr_scheduler", "trainer"}
    assert saved["trainer"]["seed"] == 3 and saved["trainer"]["max_steps"] is None  # nulls kept
    hparams = json.loads((tmp_path / "hparams.json").read_text())
    assert hparams["model"] == {"hidden": 4, "dropout": 0.0}
    assert hparams["data"] == {"samples": 64, "seed": 0}
    assert hparams["optimizer"]["class_path"] == "torch.optim.AdamW"
    assert hparams["run"]["world_size"] == 1 and hparams["run"]["effective_batch_size"] == 16
    # The saved file is a config file: it runs the same configuration again.
    again = make_cli(["--config", str(tmp_path / "config.yaml")])
    assert again.run_config == cli.run_config


def test_seed_makes_the_initial_weights_the_same_in_every_run() -> None:
    first = make_cli(["--model.hidden", "4", "--trainer.seed", "7"]).model.state_dict()
    second = make_cli(["--model.hidden", "4", "--trainer.seed", "7"]).model.state_dict()
    other = make_cli(["--model.hidden", "4", "--trainer.seed", "8"]).model.state_dict()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert not all(torch.equal(first[k], other[k]) for k in first)


def test_resume_with_a_changed_trainer_option_warns_and_saves_the_new_config(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    make_cli(run_args(tmp_path), run=True)
    with caplog.at_level(logging.WARNING, logger="distkit.trainer"):
        cli = make_cli(run_args(tmp_path, "--trainer.resume", "auto", "--trainer.max_epochs", "2"), run=True)
    assert cli.trainer.current_epoch == 2  # it resumed and trained the second epoch
    warning = "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    assert "trainer.max_epochs: 1 -> 2" in warning
    assert "resume" not in warning.split("\n", 1)[1]  # trainer.resume itself is not a change
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["trainer"]["max_epochs"] == 2


STEP_LR = ["--lr_scheduler", "StepLR", "--lr_scheduler.step_size", "3", "--lr_scheduler.gamma", "0.5"]


def test_a_scheduler_from_the_config_trains(tmp_path: Path) -> None:
    # Was: TypeError: StepLR.__init__() got multiple values for argument 'step_size' (the Trainer,
    # taking jsonargparse's (*args, **kwargs) factory for one of (optimizer, trainer), passed itself).
    cli = make_cli(run_args(tmp_path, "--optimizer.lr", "0.01", *STEP_LR), run=True)
    assert type(cli.trainer.lr_scheduler) is torch.optim.lr_scheduler.StepLR
    assert cli.trainer.global_step == 4 and cli.trainer.optimizer.param_groups[0]["lr"] == 0.01 * 0.5


@pytest.mark.parametrize("schedule", [[], STEP_LR], ids=["constant", "StepLR"])
def test_resume_with_a_changed_learning_rate_trains_with_it(tmp_path: Path, schedule: list[str]) -> None:
    make_cli(run_args(tmp_path, "--optimizer.lr", "0.01", *schedule), run=True)
    # Was: the warning said "going on with the new values", and the checkpoint's 0.01 went on.
    resumed = run_args(tmp_path, "--optimizer.lr", "0.002", "--trainer.resume", "auto", *schedule)
    cli = make_cli([*resumed, "--trainer.max_epochs", "2", "--optimizer.weight_decay", "0.5"], run=True)
    group = cli.trainer.optimizer.param_groups[0]
    assert cli.trainer.global_step == 8 and group["weight_decay"] == 0.5
    # The schedule goes on from the new rate: StepLR halved it twice more in 8 steps.
    assert group["lr"] == pytest.approx(0.002 if not schedule else 0.002 * 0.5**2)
    if schedule:
        assert cli.trainer.lr_scheduler.base_lrs == [pytest.approx(0.002)]
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["optimizer"]["init_args"]["lr"] == 0.002


def test_resume_with_changed_scheduler_settings_is_refused(tmp_path: Path) -> None:
    make_cli(run_args(tmp_path, *STEP_LR), run=True)
    # Was: warned as applied, while the restored scheduler took its old gamma back.
    changed = [*STEP_LR[:-1], "0.1", "--trainer.resume", "auto", "--trainer.max_epochs", "2"]
    with pytest.raises(DistkitError, match=r"lr_scheduler\.init_args\.gamma: 0\.5 -> 0\.1"):
        make_cli(run_args(tmp_path, *changed), run=True)


def test_resume_with_a_changed_model_is_refused_naming_keys_values_and_fix(tmp_path: Path) -> None:
    make_cli(run_args(tmp_path), run=True)
    before = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    with pytest.raises(DistkitError) as err_info:
        make_cli(
            [
                f"--trainer.default_root_dir={tmp_path}",
                "--model.hidden",
                "8",
                "--optimizer",
                "SGD",
                "--trainer.resume",
                "auto",
                "--trainer.max_epochs",
                "2",
            ],
            run=True,
        )
    message = str(err_info.value)
    assert "model.hidden: 4 -> 8" in message
    assert "optimizer.class_path: torch.optim.AdamW -> torch.optim.SGD" in message
    assert "--model.hidden 4" in message and "--trainer.default_root_dir" in message
    assert "trainer.max_epochs" not in message  # only what refuses is listed
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == before
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["model"]["hidden"] == 4


def test_a_resume_path_where_nothing_exists_stops_with_exit_2_naming_the_path_and_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Was: a FileNotFoundError traceback from fit's restore, exit status 1.
    missing = tmp_path / "does" / "not" / "exist"
    err = cli_error(run_args(tmp_path / "run", "--trainer.resume", str(missing)), capsys)
    assert f"trainer.resume: no checkpoint at {missing}: nothing exists there." in err, err
    assert "Give --trainer.resume auto" in err and "`distkit checkpoint list DIRECTORY`" in err
    err = cli_error(run_args(tmp_path / "run", "--trainer.resume", "memory://distkit-no-such/ckpt"), capsys)
    assert "no checkpoint at memory://distkit-no-such/ckpt" in err and "memory:// lives inside one" in err
    config = write_yaml(tmp_path / "run.yaml", {"trainer": {"resume": str(missing)}})
    err = cli_error(run_args(tmp_path / "run", "--config", config), capsys)
    assert f"Fix trainer.resume in {config}" in err, err
    assert not (tmp_path / "run").exists()  # nothing was trained
    # A job over several nodes: the path may be on other nodes' disks; fit's restore, on every rank
    # at once, says which ranks lack it (an exit here left the other nodes waiting in init).
    nodes = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    nodes.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29999")  # never contacted: nothing is built
    with pytest.MonkeyPatch.context() as env:
        for name, value in nodes.items():
            env.setenv(name, value)
        make_cli(run_args(tmp_path / "run", "--trainer.resume", str(missing)))
    # An existing checkpoint, given by its path, resumes.
    make_cli(run_args(tmp_path), run=True)
    last = max(p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("step_"))
    cli = make_cli(run_args(tmp_path, "--trainer.resume", str(last), "--trainer.max_epochs", "2"), run=True)
    assert cli.trainer.current_epoch == 2


def test_a_resume_path_of_a_run_or_its_checkpoints_directory_names_the_options_that_resume(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Was: ForeignCheckpointError's traceback from fit's restore, exit status 1, naming Python calls
    # (Trainer(resume=...), CheckpointManager(...).restore(state)).
    make_cli(run_args(tmp_path), run=True)
    last = max(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("step_"))
    for given in (tmp_path / "checkpoints", tmp_path):
        err = cli_error(run_args(tmp_path / "other", "--trainer.resume", str(given)), capsys)
        assert f"trainer.resume: {given} is not one checkpoint: it is a " in err, err
        assert f"--trainer.resume {tmp_path}/checkpoints/{last}, or continue that run with " in err
        assert f"--trainer.default_root_dir {tmp_path} --trainer.resume auto" in err
        assert "Trainer(" not in err and "restore(state)" not in err
    assert not (tmp_path / "other").exists()  # nothing was trained
    # A CheckpointManager directory of one's own (not a run's): no run to continue.
    (tmp_path / "checkpoints").rename(tmp_path / "saves")
    err = cli_error(run_args(tmp_path / "other", "--trainer.resume", str(tmp_path / "saves")), capsys)
    assert f"--trainer.resume {tmp_path}/saves/{last} (`distkit checkpoint list {tmp_path}/saves`" in err
    assert "continue that run" not in err
    # Another tool's checkpoint: the command that converts it, then the option.
    accelerate = tmp_path / "accelerate"
    accelerate.mkdir()
    (accelerate / "model.safetensors").write_bytes(b"")
    (accelerate / "optimizer.bin").write_bytes(b"")
    err = cli_error(run_args(tmp_path / "other", "--trainer.resume", str(accelerate)), capsys)
    assert f"`distkit checkpoint import {accelerate} DEST`, then give --trainer.resume DEST." in err, err
    # A torch.distributed.checkpoint directory is no slip: fit loads it as it is.
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP without a process group says it assumes one process
        dcp.save({"model": {"w": torch.zeros(2)}}, checkpoint_id=str(tmp_path / "dcp"))
    make_cli(run_args(tmp_path / "other", "--trainer.resume", str(tmp_path / "dcp")))


def test_resume_auto_without_a_checkpoint_starts_fresh_with_the_changed_model(tmp_path: Path) -> None:
    # A first run that saved no checkpoint left only its config.yaml: nothing to continue.
    make_cli(run_args(tmp_path, "--trainer.enable_checkpointing", "false"), run=True)
    args = [f"--trainer.default_root_dir={tmp_path}", "--model.hidden", "8", "--trainer.resume", "auto"]
    cli = make_cli(args, run=True)
    assert cli.trainer.global_step > 0
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["model"]["hidden"] == 8


# --------------------------------------------------------------------------------------------------
# Every rank parses the same config (as under torchrun or srun)


def parse_and_fit_on_every_rank(root: str, extra_on_rank_1: list[str]) -> tuple[str, int, str]:
    """Every rank parses its own command line, then fits; which ranks wrote config.yaml."""
    writes: list[int] = []
    original = _run_config.write

    def recording_write(path: Path, config: dict[str, object]) -> None:
        writes.append(distkit.get_rank())
        original(path, config)

    _run_config.write = recording_write  # type: ignore[assignment]
    args = [f"--trainer.default_root_dir={root}", "--model.hidden", "4", "--trainer.seed", "0"]
    if distkit.get_rank() == 1:
        args += extra_on_rank_1
    try:
        cli = make_cli(args, run=True, trainer_defaults={**QUIET, "logger": False})
    except DistkitError as err:
        return "error", len(writes), str(err)
    finally:
        _run_config.write = original  # type: ignore[assignment]
    digest = hashlib.sha256(json.dumps(cli.run_config, sort_keys=True).encode()).hexdigest()
    return "ok", len(writes), digest


def test_every_rank_parses_the_same_config_and_only_the_main_process_saves_it(ranks, tmp_path: Path) -> None:
    results = ranks.run(parse_and_fit_on_every_rank, str(tmp_path), [], world_size=2)
    assert [r[0] for r in results] == ["ok", "ok"]
    assert [r[1] for r in results] == [1, 0]  # rank 0 wrote it once, rank 1 never
    assert results[0][2] == results[1][2]
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert hashlib.sha256(json.dumps(saved, sort_keys=True).encode()).hexdigest() == results[0][2]


def test_ranks_with_different_configs_fail_on_every_rank_naming_the_key(ranks, tmp_path: Path) -> None:
    # A dropout that differs: DDP's own check of the parameters' shapes would not see it.
    results = ranks.run(parse_and_fit_on_every_rank, str(tmp_path), ["--model.dropout", "0.5"], world_size=2)
    for status, writes, message in results:
        assert status == "error" and writes == 0
        assert "rank 1: model.dropout = 0.5 (rank 0: 0.0)" in message
        assert "same command line" in message
    assert not (tmp_path / "config.yaml").exists()


def test_under_plain_python_fit_starts_the_processes_with_the_config_parsed_once(tmp_path: Path) -> None:
    # The launching process parsed; the workers get the built objects (the Trainer with its
    # run_config) by pickle, and their rank 0 saves the config.
    cli = make_cli(run_args(tmp_path, "--trainer.strategy", "ddp", "--trainer.devices", "2"), run=True)
    assert cli.trainer.world_size == 2 and cli.trainer.global_step > 0
    assert yaml.safe_load((tmp_path / "config.yaml").read_text()) == cli.run_config
    hparams = json.loads((tmp_path / "hparams.json").read_text())
    assert hparams["run"]["world_size"] == 2 and hparams["trainer"]["devices"] == 2


# --------------------------------------------------------------------------------------------------
# What a careless config meant, read as it meant it (driven as users write them)


class Named(nn.Module):
    """TinyNet with text options, one of them a template whose default holds ``${epoch}``.

    Args:
        hidden: Width of the hidden layer.
        name: A run name.
        fmt: A file name template.
    """

    def __init__(self, hidden: int = 4, name: str = "net", fmt: str = "ckpt-${epoch}") -> None:
        super().__init__()
        self.name, self.fmt = name, fmt
        self.net = TinyNet(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def named_cli(args: list[str], *, run: bool = False) -> TrainerCLI:
    return TrainerCLI(
        Named, blobs, loss_fn=nn.functional.cross_entropy, trainer_defaults=QUIET, args=args, run=run
    )


def test_an_empty_section_is_refused_not_read_as_dropping_every_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("model:\n  hidden: 4\ntrainer:\n  # max_epochs: 5\n")
    # Was: trainer: None, and the Trainer built without the script's trainer_defaults, in silence.
    err = cli_error(["--config", str(config)], capsys)
    assert f"trainer: in {config} is empty, which YAML reads as null" in err, err
    assert "write trainer: {} for none" in err
    config.write_text("model:\n  hidden: 4\noptimizer:\n  # class_path: SGD\n")
    # Was: a TypeError from fit, "optimizer must be a torch.optim.Optimizer ..., got NoneType".
    err = cli_error(["--config", str(config)], capsys)
    assert f"optimizer: in {config} is empty" in err and "delete the line to keep the script's" in err, err


def test_a_string_value_that_reads_as_yaml_is_a_value_not_a_config_with_duplicate_keys(
    tmp_path: Path,
) -> None:
    config = write_yaml(tmp_path / "run.yaml", {"model": {"name": "{a: 1, a: 2}"}})
    # Was: "duplicate key a in run.yaml (line 1, twice)": jsonargparse loads string values as YAML too.
    assert named_cli(["--config", config]).model.name == "{a: 1, a: 2}"
    assert named_cli(["--model.name", "{epoch, epoch}"]).model.name == "{epoch, epoch}"


def test_a_boolean_word_for_a_text_option_is_named_with_the_quotes_that_keep_it_text(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("model:\n  hidden: 4\n  name: off\n")
    # Was: "model.name: expected str, got 'False'": a value the file does not hold.
    with pytest.raises(SystemExit) as exit_info:
        named_cli(["--config", str(config)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert f"model.name in {config} (line 3) is off unquoted, which YAML reads as the boolean false" in err
    assert 'Quote it for the text: name: "off".' in err and "'False'" not in err, err
    config.write_text('model:\n  hidden: 4\n  name: "off"\n')
    assert named_cli(["--config", str(config)]).model.name == "off"
    assert named_cli(["--model.name", "yes"]).model.name == "yes"  # the command line keeps text
    # A boolean option takes the word as YAML means it.
    config.write_text("model:\n  hidden: 4\ntrainer:\n  enable_checkpointing: no\n")
    assert named_cli(["--config", str(config)]).run_config["trainer"]["enable_checkpointing"] is False


def test_a_config_read_from_a_pipe_is_read_by_the_parser_whole(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import os

    def piped(text: bytes) -> int:
        read, write = os.pipe()
        os.write(write, text)
        os.close(write)
        return read

    read = piped(b"model:\n  hidden: 5\n")
    try:
        # Was: "Unexpected config: ", the checks having read the pipe before jsonargparse.
        cli = make_cli(["--config", f"/dev/fd/{read}"])
    finally:
        os.close(read)
    assert cli.run_config["model"]["hidden"] == 5
    # And the checks read it too (its copy): an empty section, named as the pipe it came from.
    read = piped(b"model:\n  hidden: 5\ntrainer:\n  # max_epochs: 3\n")
    try:
        with pytest.raises(SystemExit):
            make_cli(["--config", f"/dev/fd/{read}"])
    finally:
        os.close(read)
    assert f"trainer: in /dev/fd/{read} is empty" in capsys.readouterr().err


def test_variables_a_shell_would_expand_are_refused_and_the_scripts_own_defaults_are_not(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # where the literal directory would go, were the value taken
    monkeypatch.setenv("DISTKIT_TEST_SCRATCH", "/scratch")
    config = tmp_path / "run.yaml"
    config.write_text("trainer:\n  default_root_dir: $DISTKIT_TEST_SCRATCH/runs\n")
    # Was: a directory named '$DISTKIT_TEST_SCRATCH' (only ${NAME} was refused).
    err = cli_error(["--config", str(config), "--model.hidden", "4"], capsys)
    assert "$DISTKIT_TEST_SCRATCH is not expanded in a config file" in err, err
    # An unset $name is a template's, as string.Template writes it: taken as it is.
    config.write_text("model:\n  name: exp-$epoch\n")
    assert named_cli(["--config", str(config)]).model.name == "exp-$epoch"
    # The script's own default with ${epoch} goes through config.yaml and --print_config and back.
    named_cli([f"--trainer.default_root_dir={tmp_path / 'run'}"], run=True)
    saved = tmp_path / "run" / "config.yaml"
    assert "ckpt-${epoch}" in saved.read_text()
    again = named_cli(["--config", str(saved), "--trainer.resume", "auto"])
    assert again.model.fmt == "ckpt-${epoch}"
    with pytest.raises(SystemExit) as exit_info:
        named_cli(["--config", str(saved), "--model.fmt", "x-${epoch}"])
    assert exit_info.value.code == 2 and "${epoch} was not expanded" in capsys.readouterr().err


def test_an_empty_max_epochs_stops_with_exit_2_naming_the_file_and_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Was: fit's ValueError "give the Trainer max_epochs or max_steps" as a traceback, exit 1.
    config = tmp_path / "run.yaml"
    config.write_text("trainer:\n  max_epochs:\n")
    err = cli_error(run_args(tmp_path / "run", "--config", str(config)), capsys)
    assert f"trainer.max_epochs is empty (null) in {config} and trainer.max_steps is not set" in err, err
    assert "(--trainer.max_epochs N or --trainer.max_steps N)" in err, err
    err = cli_error(run_args(tmp_path / "run", "--trainer.max_epochs", "null"), capsys)
    assert "trainer.max_epochs and trainer.max_steps are both null" in err, err
    assert not (tmp_path / "run").exists()
    # Either one set is enough.
    make_cli(run_args(tmp_path / "run", "--config", str(config), "--trainer.max_steps", "2"), run=True)


def test_resume_null_on_the_command_line_means_no_resume(tmp_path: Path) -> None:
    config = write_yaml(tmp_path / "run.yaml", {"trainer": {"resume": "auto"}})
    # Was: "no checkpoint at None": jsonargparse reads null as the text 'None' for a path type.
    cli = make_cli(["--config", config, "--model.hidden", "4", "--trainer.resume", "null"])
    assert cli.trainer.resume is None and cli.run_config["trainer"]["resume"] is None


def test_a_resume_url_of_a_store_whose_filesystem_is_not_installed_is_left_to_fit(tmp_path: Path) -> None:
    pytest.importorskip("fsspec")
    try:
        import gcsfs  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("gcsfs is installed here: the URL would be looked up on the network")
    # Was: fsspec's ImportError ("Please install gcsfs") as a traceback while the config was read.
    cli = make_cli(run_args(tmp_path, "--trainer.resume", "gs://bucket/run/step_000000001"))
    assert cli.trainer.resume == "gs://bucket/run/step_000000001"


def test_a_config_file_that_is_not_utf8_is_named_with_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "run.yaml"
    config.write_bytes(b"model:\n  hidden: 4\ndata:\n  seed: 1 # caf\xe9\n")
    # Was: a UnicodeDecodeError traceback.
    err = cli_error(["--config", str(config)], capsys)
    assert f"the config file {config} is not UTF-8 text (byte 0xe9 at offset" in err, err


def test_a_rerun_over_a_runs_checkpoints_is_refused_with_the_command_lines_fixes(tmp_path: Path) -> None:
    make_cli(run_args(tmp_path), run=True)
    # Was: the Python API's fixes, Trainer(resume='auto') and callbacks=[ModelCheckpoint(...)].
    with pytest.raises(distkit.CheckpointConflictError) as refused:
        make_cli(["--config", str(tmp_path / "config.yaml")], run=True)
    said = str(refused.value)
    assert "(--trainer.resume not given). Continue that run with --trainer.resume auto" in said, said
    assert "--trainer.default_root_dir DIR" in said and "Trainer(" not in said
