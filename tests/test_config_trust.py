"""A TrainerCLI config is data, not code: every class path must name a subclass of the base its key
declares (``torch.optim.Optimizer``, ``LRScheduler``, ``nn.Module``, ``Callback``, ``Logger``, or the
user's own type hint), checked before anything is instantiated. Functions, built-ins and
``functools.partial`` named by a config are refused, and nothing they would do happens; a script
allows a factory on purpose with ``TrainerCLI(allow_callables=...)``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from torch import nn
from torch.utils.data import TensorDataset

from distkit.trainer.config_cli import TrainerCLI

QUIET = {"enable_progress_bar": False, "max_epochs": 1, "batch_size": 16}
# The marker each case's callable would create if the config could run it.
MARKER = "MARKER"


class Net(nn.Module):
    """A small network whose activation is an option typed ``nn.Module``.

    Args:
        hidden: Width of the hidden layer.
        act: The activation module (a class path in a config).
    """

    def __init__(self, hidden: int = 4, act: nn.Module | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, hidden), act or nn.ReLU(), nn.Linear(hidden, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def blobs(samples: int = 32) -> TensorDataset:
    """Two classes of points.

    Args:
        samples: How many.
    """
    x = torch.randn(samples, 4, generator=torch.Generator().manual_seed(0))
    return TensorDataset(x, (x[:, 0] > 0).long())


FACTORY_CALLS: list[str] = []


def make_sgd(params: Any) -> torch.optim.SGD:
    """A function returning an optimizer: what a factory in a config would name."""
    FACTORY_CALLS.append("make_sgd")
    return torch.optim.SGD(params, lr=0.5)


MAKE_SGD = f"{make_sgd.__module__}.make_sgd"


def cli(args: list[str], **kwargs: Any) -> TrainerCLI:
    return TrainerCLI(
        Net,
        blobs,
        loss_fn=nn.functional.cross_entropy,
        trainer_defaults=QUIET,
        args=args,
        run=False,
        **kwargs,
    )


def cases(marker: str) -> dict[str, tuple[dict[str, Any], str, str]]:
    """name -> (config, the key named in the error, the base named in the error)."""
    touch = f"touch {marker}"
    opens = f"open({marker!r}, 'w')"
    return {
        "os.system as the optimizer": (
            {"optimizer": {"class_path": "os.system", "init_args": {"command": touch}}},
            "optimizer",
            "torch.optim.Optimizer",
        ),
        "subprocess.run under an Any-typed option": (
            {
                "trainer": {
                    "logger": {
                        "class_path": "distkit.trainer.tracking.WandbLogger",
                        "init_args": {
                            "init_kwargs": {
                                "x": {
                                    "class_path": "subprocess.run",
                                    "init_args": {"args": ["touch", marker]},
                                }
                            }
                        },
                    }
                }
            },
            "trainer.logger.init_args.init_kwargs.x",
            "declares no base class",
        ),
        "builtins.exec as the scheduler": (
            {"lr_scheduler": {"class_path": "builtins.exec", "init_args": {"source": opens}}},
            "lr_scheduler",
            "torch.optim.lr_scheduler.LRScheduler",
        ),
        "eval as a callback": (
            {"trainer": {"callbacks": [{"class_path": "builtins.eval", "init_args": {"source": opens}}]}},
            "trainer.callbacks[0]",
            "distkit.Callback",
        ),
        "os.system as a logger": (
            {"trainer": {"logger": {"class_path": "os.system", "init_args": {"command": touch}}}},
            "trainer.logger",
            "distkit.Logger",
        ),
        "functools.partial as the optimizer": (
            {"optimizer": {"class_path": "functools.partial", "init_args": {"func": "os.system"}}},
            "optimizer",
            "torch.optim.Optimizer",
        ),
        "a function returning an optimizer": ({"optimizer": MAKE_SGD}, "optimizer", "torch.optim.Optimizer"),
        "os.system for the user's nn.Module option": (
            {"model": {"act": {"class_path": "os.system", "init_args": {"command": touch}}}},
            "model.act",
            "torch.nn.Module",
        ),
    }


@pytest.mark.parametrize("case", list(cases("x")))
def test_a_class_path_naming_a_callable_is_refused_before_anything_is_called(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / MARKER
    config, key, base = cases(str(marker))[case]
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    FACTORY_CALLS.clear()
    with pytest.raises(SystemExit) as exit_info:
        cli(["--config", str(path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"error: {key}: " in err, err
    assert base in err and "Nothing was called" in err and "allow_callables=" in err, err
    assert str(path) in err, err  # the file it came from
    assert not marker.exists() and FACTORY_CALLS == []


def test_the_same_callables_on_the_command_line_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    for args, key in (
        (["--optimizer", MAKE_SGD], "optimizer"),
        (
            ["--trainer.callbacks", '[{"class_path": "os.system", "init_args": {"command": "true"}}]'],
            "trainer.callbacks",
        ),
    ):
        with pytest.raises(SystemExit):
            cli(args)
        err = capsys.readouterr().err
        assert f"error: {key}" in err and "Nothing was called" in err, err
    assert FACTORY_CALLS == []


@pytest.mark.parametrize("allowed", [make_sgd, MAKE_SGD], ids=["function", "import path"])
def test_a_factory_the_script_allows_may_be_named_by_the_config(tmp_path: Path, allowed: Any) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"optimizer": MAKE_SGD}))
    built = cli(["--config", str(path)], allow_callables=[allowed])
    assert built.optimizer is make_sgd
    optimizer = built.optimizer(built.model.parameters())
    assert type(optimizer) is torch.optim.SGD and optimizer.defaults["lr"] == 0.5


def test_subclasses_of_the_declared_bases_still_build(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    config = {
        "model": {"act": {"class_path": "torch.nn.Tanh"}},
        "optimizer": {"class_path": "SGD", "init_args": {"lr": 0.2}},
        "lr_scheduler": {"class_path": "torch.optim.lr_scheduler.StepLR", "init_args": {"step_size": 2}},
        "trainer": {
            "callbacks": [{"class_path": "distkit.trainer.EarlyStopping", "init_args": {"patience": 2}}],
            "logger": [{"class_path": "distkit.trainer.CSVLogger"}],
            "strategy": {"class_path": "distkit.trainer.DDPStrategy"},
        },
    }
    path.write_text(yaml.safe_dump(config))
    built = cli(["--config", str(path)])
    assert isinstance(built.model.net[1], nn.Tanh)
    assert type(built.optimizer(built.model.parameters())) is torch.optim.SGD


def test_allow_callables_names_an_import_path_it_cannot_resolve() -> None:
    with pytest.raises(ValueError, match=r"allow_callables: cannot import 'mypackage\.nope'"):
        cli([], allow_callables=["mypackage.nope"])
    with pytest.raises(TypeError, match=r"allow_callables=\['os\.system'\]"):
        cli([], allow_callables="os.system")  # type: ignore[arg-type]
