"""Lightning users' habits, each ported in our words from the peer's own test (named there):
ckpt_path="best"/"last", Trainer.save_checkpoint, val_check_interval as a fraction of an epoch, and a
Trainer made only to evaluate, without max_epochs or max_steps; and what a training_step returns by
mistake (None, loss.item(), a tuple, a misspelt key); and a LightningModule's members (self.log,
self.trainer, self.device) asked of a plain module."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

import distkit
from distkit.testing import Ranks
from distkit.trainer import Callback, ModelCheckpoint, TrainerView


def _data(n: int = 64, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, (x.sum(1) > 0).long())


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


def _trainer(root: Path | str, **options: Any) -> distkit.Trainer:
    defaults: dict[str, Any] = {
        "batch_size": 1,
        "logger": False,
        "enable_progress_bar": False,
        "default_root_dir": root,
        "seed": 0,
    }
    defaults.update(options)
    return distkit.Trainer(**defaults)


def _fit(trainer: distkit.Trainer, model: nn.Module, **options: Any) -> None:
    trainer.fit(
        model,
        _data(),
        _data(16, seed=1),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.05),
        loss_fn=nn.functional.cross_entropy,
        **options,
    )


class CountValidations(Callback):
    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_validation_end(self, trainer: TrainerView, metrics: dict[str, float]) -> None:
        self.steps.append(trainer.global_step)


@pytest.mark.parametrize("max_epochs", [1, 2, 3])
@pytest.mark.parametrize("interval", [1.0, 0.25, 0.33])
def test_a_fraction_of_an_epoch_validates_that_often_in_every_epoch(
    tmp_path: Path, max_epochs: int, interval: float
) -> None:
    # Lightning's tests/trainer/flags/test_val_check_interval.py (test_val_check_interval): 64
    # batches an epoch, val_check_interval=1/k validates round(k) times in every epoch. Here the
    # last of them is the epoch's last step (Lightning's 0.33 validates at 21, 42, 63 of 64).
    counter = CountValidations()
    trainer = _trainer(
        tmp_path,
        max_epochs=max_epochs,
        val_check_interval=interval,
        callbacks=[counter],
        enable_checkpointing=False,
    )
    _fit(trainer, _model())
    assert len(counter.steps) == max_epochs * round(1 / interval)
    times = round(1 / interval)
    assert counter.steps[:times] == [round(k * 64 / times) for k in range(1, times + 1)]


def test_a_fraction_ranks_the_epoch_end_checkpoint_for_ckpt_path_best(tmp_path: Path) -> None:
    checkpoint = ModelCheckpoint(monitor="val_loss", keep_best=1, every_n_minutes=None)
    trainer = _trainer(tmp_path, max_epochs=2, val_check_interval=0.33, batch_size=8, callbacks=[checkpoint])
    _fit(trainer, _model())  # 8 steps an epoch: validations at 3, 5, 8 (and 11, 13, 16)
    assert checkpoint.manager.best() is not None
    assert trainer.validate(_model(), _data(16), ckpt_path="best", loss_fn=nn.functional.cross_entropy)


def test_an_int_interval_still_counts_optimizer_steps_across_epochs(tmp_path: Path) -> None:
    counter = CountValidations()
    trainer = _trainer(
        tmp_path, max_epochs=2, val_check_interval=48, callbacks=[counter], enable_checkpointing=False
    )
    _fit(trainer, _model())
    assert counter.steps == [48, 64, 96, 128]  # every 48 steps, and at each epoch's end


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"val_check_interval": 1.5}, ValueError, r"fraction of an epoch, in \(0, 1\]"),
        ({"val_check_interval": 0.5, "check_val_every_n_epoch": None}, ValueError, "check_val_every_n_epoch"),
        ({"val_check_interval": "2"}, TypeError, "an int .* or a float"),
        ({"val_check_interval": 0}, ValueError, "must be >= 1"),
    ],
)
def test_a_bad_val_check_interval_says_what_each_kind_means(
    tmp_path: Path, options: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        _trainer(tmp_path, max_epochs=1, **options)


def test_a_trainer_made_only_to_evaluate_needs_no_max_epochs(tmp_path: Path) -> None:
    # Lightning builds `Trainer()` with no limits for trainer.validate/test/predict throughout its
    # tests (tests_pytorch/trainer/test_trainer.py); fit() is what needs to know when to stop.
    trainer = _trainer(tmp_path, enable_checkpointing=False)
    metrics = trainer.validate(_model(), _data(16), loss_fn=nn.functional.cross_entropy)
    assert set(metrics) == {"val_loss"}
    assert trainer.predict(_model(), _data(16)).shape == (16, 2)
    with pytest.raises(ValueError, match="give the Trainer max_epochs or max_steps"):
        _fit(trainer, _model())


def _weights_of(path: str) -> list[torch.Tensor]:
    model = _model()
    distkit.load_checkpoint(path, {"model": model}, strict=False)
    return [p.detach().clone() for p in model.parameters()]


def test_ckpt_path_best_and_last_evaluate_the_checkpoints_of_the_modelcheckpoint(tmp_path: Path) -> None:
    # Lightning's tests_pytorch/trainer/test_trainer.py (test_tested_checkpoint_path): validate and
    # test with ckpt_path="best" load the best checkpoint, "last" the latest.
    checkpoint = ModelCheckpoint(monitor="val_loss", keep_best=1, keep_last=1, every_n_minutes=None)
    trainer = _trainer(tmp_path, max_epochs=3, callbacks=[checkpoint], batch_size=16)
    _fit(trainer, _model())
    best, last = checkpoint.manager.best(), checkpoint.manager.latest()
    assert best is not None and last is not None
    for which, path in (("best", best), ("last", last)):
        expected = _model()
        distkit.load_checkpoint(path, {"model": expected}, strict=False)
        want = _trainer(tmp_path / "check", batch_size=16, enable_checkpointing=False).validate(
            expected, _data(16, seed=1), loss_fn=nn.functional.cross_entropy
        )
        got = trainer.validate(
            _model(), _data(16, seed=1), ckpt_path=which, loss_fn=nn.functional.cross_entropy
        )
        assert got == want, which
        assert trainer.test(
            _model(), _data(16, seed=1), ckpt_path=which, loss_fn=nn.functional.cross_entropy
        )["test_loss"] == pytest.approx(want["val_loss"])


def test_fit_with_ckpt_path_last_continues_the_run(tmp_path: Path) -> None:
    # Lightning's trainer.fit(model, ckpt_path="last") resumes from the latest checkpoint.
    first = _trainer(tmp_path, max_epochs=1, batch_size=16)
    _fit(first, _model())
    again = _trainer(tmp_path, max_epochs=2, batch_size=16)
    _fit(again, _model(), ckpt_path="last")
    assert again.global_step == 8 and again.resume is None  # 4 steps an epoch, resumed at 4
    fresh = _trainer(tmp_path / "other", max_epochs=1, batch_size=16)
    _fit(fresh, _model(), ckpt_path="last")  # nothing there yet: a fresh start, as resume="auto"
    assert fresh.global_step == 4


def test_ckpt_path_best_without_a_monitor_or_a_checkpoint_says_why(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, max_epochs=1, batch_size=16)
    with pytest.raises(ValueError, match="has none: give it one"):
        trainer.validate(_model(), _data(16), ckpt_path="best", loss_fn=nn.functional.cross_entropy)
    with pytest.raises(ValueError, match="holds no checkpoint yet"):
        trainer.validate(_model(), _data(16), ckpt_path="last", loss_fn=nn.functional.cross_entropy)
    off = _trainer(tmp_path, max_epochs=1, enable_checkpointing=False)
    with pytest.raises(ValueError, match="checkpointing is off"):
        off.validate(_model(), _data(16), ckpt_path="last", loss_fn=nn.functional.cross_entropy)


def test_a_slip_of_auto_last_or_best_is_named_not_searched_for_as_a_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    for slip in ("atuo", "Auto", "aut"):
        with pytest.raises(
            ValueError,
            match=rf"resume='{slip}' is neither 'auto' nor an existing .* "
            r"Did you mean resume='auto'\?",
        ):
            _trainer(tmp_path, resume=slip)
    trainer = _trainer(tmp_path, max_epochs=1, batch_size=16)
    with pytest.raises(ValueError, match=r"Did you mean ckpt_path='last'\?"):
        _fit(trainer, _model(), ckpt_path="lats")
    with pytest.raises(ValueError, match=r"Did you mean ckpt_path='best'\?"):
        trainer.validate(_model(), _data(16), ckpt_path="Best", loss_fn=nn.functional.cross_entropy)
    assert trainer.global_step == 0  # nothing ran
    # A path that exists is a path, whatever its name; one far from the words is looked for.
    (tmp_path / "atuo").mkdir()
    assert _trainer(tmp_path, resume="atuo").resume == "atuo"
    with pytest.raises(FileNotFoundError, match="checkpoint not found: runs/old does not exist"):
        _fit(_trainer(tmp_path, max_epochs=1, batch_size=16), _model(), ckpt_path="runs/old")


def test_a_monitor_that_names_no_metric_stops_fit_naming_the_closest_one(tmp_path: Path) -> None:
    # ModelCheckpoint(monitor="val_los") used to rank nothing in silence: no best checkpoint, and
    # ckpt_path="best" failing only later.
    for callback in (
        ModelCheckpoint(monitor="val_los", keep_best=1),
        distkit.trainer.EarlyStopping("val_los"),
    ):
        trainer = _trainer(
            tmp_path / type(callback).__name__, max_epochs=2, batch_size=16, callbacks=[callback]
        )
        with pytest.raises(KeyError, match=r"monitors 'val_los', .* Did you mean 'val_loss'\?"):
            _fit(trainer, _model())
        assert trainer.global_step == 4  # at the end of the first epoch, whose validation names its metrics
    # A monitor whose epoch has no validation yet waits for one that has.
    trainer = _trainer(
        tmp_path / "every2",
        max_epochs=1,
        batch_size=16,
        check_val_every_n_epoch=2,
        callbacks=[ModelCheckpoint(monitor="val_acc", keep_best=1)],
    )
    _fit(trainer, _model())
    assert trainer.global_step == 4


def fit_then_save(root: str, path: str) -> list[float]:
    trainer = _trainer(root, max_epochs=1, batch_size=8, enable_checkpointing=False)
    model = _model()
    _fit(trainer, model)
    trainer.save_checkpoint(path)  # on every rank
    again = _trainer(root, max_epochs=2, batch_size=8, enable_checkpointing=False, resume=path)
    resumed = _model()
    _fit(again, resumed)
    steps = [float(trainer.global_step), float(again.global_step)]
    return [float(p.sum()) for p in model.parameters()] + steps


def test_save_checkpoint_on_every_rank_writes_a_checkpoint_a_trainer_resumes(
    ranks: Ranks, tmp_path: Path
) -> None:
    # Lightning's trainer.save_checkpoint (tests_pytorch/checkpointing/test_trainer_checkpoint.py):
    # a checkpoint written after fit, from which training goes on.
    out = ranks.run(fit_then_save, str(tmp_path), str(tmp_path / "manual"))
    assert out[0] == out[1]
    assert out[0][-2:] == [4.0, 8.0], out[0]
    assert (tmp_path / "manual" / "manifest.json").exists()


def save_on_rank_0_only(root: str) -> tuple[float, str] | None:
    distkit.init("gloo", hang_timeout_s=0)  # no watchdog: the refusal alone must end the wait
    trainer = _trainer(root, max_epochs=1, batch_size=8, enable_checkpointing=False, hang_timeout_s=None)
    _fit(trainer, _model())
    result = None
    if distkit.get_rank() == 0:
        start = time.monotonic()
        outcome: list[Any] = []

        def call() -> None:
            try:
                trainer.save_checkpoint(str(Path(root) / "alone"))
                outcome.append("returned")
            except distkit.CollectiveMismatchError as err:
                outcome.append((time.monotonic() - start, str(err)))

        caller = threading.Thread(target=call, daemon=True)
        caller.start()
        caller.join(20.0)
        assert outcome and outcome[0] != "returned", outcome
        result = outcome[0]
    dist.barrier()
    return result


def test_save_checkpoint_on_one_rank_is_refused_at_once(ranks: Ranks, tmp_path: Path) -> None:
    out = ranks.run(save_on_rank_0_only, str(tmp_path), fresh=True, init=False, timeout_s=120)
    elapsed, message = out[0]
    assert elapsed < 15, elapsed
    assert "all_gather_object" in message and "call it on every rank" in message, message


class _Returns(nn.Module):
    """A Lightning-style module whose training_step returns ``what(loss)``."""

    def __init__(self, what: Any) -> None:
        super().__init__()
        self.net, self.what = _model(), what

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        return self.what(nn.functional.cross_entropy(self(x), y))


@pytest.mark.parametrize(
    ("what", "expected"),
    [
        (lambda loss: None, r"got None: end it with `return loss`"),
        (lambda loss: loss.item(), r"got a float \(.*\): return the loss tensor itself, not loss\.item\(\)"),
        (lambda loss: {"los": loss}, r"got a dict without it \(keys: 'los'\)\. Did you mean 'loss' instead"),
        (lambda loss: (loss, 1.0), r"got a tuple of 2; return \{'loss': loss, 'name': value, \.\.\.\}"),
        (lambda loss: loss.detach(), r"one-element loss tensor that requires grad .*not detached"),
    ],
)
def test_a_training_step_that_returns_no_loss_says_what_to_return(
    tmp_path: Path, what: Any, expected: str
) -> None:
    trainer = _trainer(tmp_path, max_steps=1)
    with pytest.raises(TypeError, match=expected):
        trainer.fit(_Returns(what), _data(), optimizer=lambda params: torch.optim.SGD(params, lr=0.1))


class _AsksFor(nn.Module):
    """A model whose training_step and validation_step read ``self.<name>``, as a LightningModule's do."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.net, self.name = _model(), name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        getattr(self, self.name)
        return nn.functional.cross_entropy(self(batch[0]), batch[1])

    validation_step = training_step


@pytest.mark.parametrize(
    ("name", "instead"),
    [
        ("log", r"return the values instead: training_step's dict beside 'loss'"),
        ("trainer", r"a Callback's hooks get the Trainer \(on_train_step_end\(trainer, loss\)\)"),
        ("device", r"next\(self\.parameters\(\)\)\.device"),
        ("log_dict", r"return the values instead"),
    ],
)
def test_a_lightningmodule_member_the_model_asks_for_is_named_with_what_to_use(
    tmp_path: Path, name: str, instead: str
) -> None:
    expected = rf"no attribute '{name}'\ndistkit: self\.{name} is a LightningModule's.*{instead}"
    with pytest.raises(AttributeError, match=expected):
        _trainer(tmp_path, max_steps=1).fit(
            _AsksFor(name), _data(), optimizer=lambda params: torch.optim.SGD(params, lr=0.1)
        )
    with pytest.raises(AttributeError, match=expected):
        _trainer(tmp_path).validate(_AsksFor(name), _data())


class _LightningCounter(Callback):
    def on_train_batch_end(self, trainer: TrainerView, *args: Any) -> None:
        raise AssertionError("never called")


class _MisspeltHook(Callback):
    def on_fit_ends(self, trainer: TrainerView) -> None:
        raise AssertionError("never called")


@pytest.mark.parametrize(
    ("callback", "said"),
    [
        (
            _LightningCounter(),
            "callback _LightningCounter defines on_train_batch_end(), which distkit's Trainer never "
            "calls (Lightning's name; here it is on_train_step_end(trainer, loss), after every optimizer "
            "step). The Trainer's hooks: on_fit_start, ",
        ),
        (
            _MisspeltHook(),
            "callback _MisspeltHook defines on_fit_ends(), which distkit's Trainer never calls (did "
            "you mean on_fit_end?)",
        ),
    ],
)
def test_a_callback_method_the_trainer_never_calls_is_refused_naming_the_hook_meant(
    tmp_path: Path, callback: Callback, said: str
) -> None:
    """Was: the method never ran, without a word (a Lightning port's step counter stayed at 0)."""
    with pytest.raises(TypeError) as caught:
        _trainer(tmp_path, max_steps=1, callbacks=[callback])
    assert str(caught.value).startswith(said), caught.value
    assert "Rename the method (a helper of your own" in str(caught.value)


def test_an_attribute_no_lightningmodule_has_gets_no_note(tmp_path: Path) -> None:
    with pytest.raises(AttributeError) as caught:
        _trainer(tmp_path).validate(_AsksFor("hiden"), _data())
    assert str(caught.value) == "'_AsksFor' object has no attribute 'hiden'"


def test_a_scheduler_shorter_than_the_run_is_named_with_its_length_and_the_fix(tmp_path: Path) -> None:
    def short(optimizer: torch.optim.Optimizer) -> Any:
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=3)

    trainer = _trainer(tmp_path, max_epochs=1, batch_size=8, enable_checkpointing=False)
    # Was: torch's "Tried to step 4 times" alone, mid-run (as after a resume on fewer ranks).
    expected = (
        r"Tried to step 4 times.*\ndistkit: the learning-rate scheduler \(OneCycleLR\) was made for 3 steps"
    )
    with pytest.raises(ValueError, match=expected) as caught:
        trainer.fit(
            _model(),
            _data(),
            optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
            loss_fn=nn.functional.cross_entropy,
            lr_scheduler=short,
        )
    assert "total_steps=trainer.total_steps" in str(caught.value)


def test_a_mid_epoch_resume_with_another_accumulation_is_refused_and_one_at_an_epoch_end_is_not(
    tmp_path: Path,
) -> None:
    """Was: accepted without a word, a step of one micro-batch scaled by 1/2 where the saved step
    ended, and an epoch of another length than the scheduler's (batch_size was refused already)."""
    # 64 samples, batch 4: 16 batches an epoch; accumulating 3, the checkpoint at step 3 is 9 in.
    first = _trainer(tmp_path, batch_size=4, max_steps=3, accumulate_grad_batches=3, resume="auto")
    _fit(first, _model())
    again = _trainer(tmp_path, batch_size=4, max_epochs=1, accumulate_grad_batches=2, resume="auto")
    with pytest.raises(
        ValueError,
        match=r"cannot resume mid-epoch \(9 batches into the epoch\) with "
        r"accumulate_grad_batches=2: the checkpoint was saved with 3",
    ):
        _fit(again, _model())
    # From an epoch's end (the first run finished its epoch), another accumulation is fine.
    whole = _trainer(tmp_path / "b", batch_size=4, max_epochs=1, accumulate_grad_batches=3, resume="auto")
    _fit(whole, _model())
    more = _trainer(tmp_path / "b", batch_size=4, max_epochs=2, accumulate_grad_batches=2, resume="auto")
    _fit(more, _model())
    assert more.global_step == 6 + 8 and more.total_steps == 14


def test_a_mid_epoch_resume_with_another_batch_size_is_refused_in_the_trainers_terms(tmp_path: Path) -> None:
    first = _trainer(tmp_path, batch_size=4, max_steps=3, resume="auto")
    _fit(first, _model())
    again = _trainer(tmp_path, batch_size=8, max_epochs=1, resume="auto")
    # Was: the loader's own advice, "set state['batches_consumed'] = 0", a state no Trainer user holds.
    with pytest.raises(ValueError) as caught:
        _fit(again, _model())
    said = str(caught.value)
    assert said.startswith(
        "cannot resume mid-epoch (3 batches into epoch 0) with another batch size (saved 4, now 8: "
        "Trainer(batch_size=4), or the batch_size of the loader given to fit)"
    ), said
    assert "from a checkpoint saved at an epoch's end" in said and "batches_consumed" not in said


class _Grows(Callback):
    """Adds samples to the training dataset in the middle of the first epoch."""

    def __init__(self, data: list[Any]) -> None:
        self.data = data

    def on_train_step_end(self, trainer: TrainerView, loss: torch.Tensor) -> None:
        if trainer.global_step == 2:
            self.data.extend(self.data[:5])


def test_a_training_dataset_that_grows_during_fit_is_named_with_the_trainers_fix(tmp_path: Path) -> None:
    samples = list(_data(20))
    trainer = _trainer(tmp_path, batch_size=4, max_epochs=2, callbacks=[_Grows(samples)])
    # Was: "make a new loader (on every rank)", the loader's fix for a loader the Trainer made.
    with pytest.raises(distkit.DistkitError) as caught:
        trainer.fit(
            _model(),
            samples,
            optimizer=lambda p: torch.optim.SGD(p, lr=0.05),
            loss_fn=nn.functional.cross_entropy,
        )
    said = str(caught.value)
    assert said.startswith("the training dataset had 20 samples when fit() made its loader and has 25 now"), (
        said
    )
    assert "start another fit()" in said and "make a new loader" not in said


@pytest.mark.parametrize(
    ("options", "said"),
    [
        (
            {"every_n_epochs": None},
            r"every_n_epochs must be an int >= 0 \(0 turns epoch saves off\), got None",
        ),
        ({"every_n_steps": "5"}, r"every_n_steps must be an int >= 1 or None, got '5'"),
    ],
)
def test_modelcheckpoint_rhythms_of_another_type_are_refused_when_made(
    options: dict[str, Any], said: str
) -> None:
    # Was: every_n_epochs=None (Lightning's "not by epochs") failed at the first epoch's end with
    # "'<' not supported between instances of 'NoneType' and 'int'".
    with pytest.raises(ValueError, match=said):
        ModelCheckpoint(**options)
