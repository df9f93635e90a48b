"""Issue 15 on real 2-rank gloo groups and real processes: validation every N steps (resume stays
exact), ``Trainer.validate``/``test``/``predict`` (exact, every sample once, in dataset order, under
the pool, self-launch and one process, from a checkpoint), models whose forward takes the target,
schedules in epochs and the learning rates the start-up report shows."""

from __future__ import annotations

import functools
import io
import json
import os
import pathlib
import subprocess
import sys
from contextlib import redirect_stdout
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import distkit
from distkit.errors import DistkitError
from distkit.trainer import Callback, ModelCheckpoint, Trainer, accuracy, warmup_schedule

REPO = pathlib.Path(__file__).parent.parent
CE = nn.functional.cross_entropy
SGD01 = functools.partial(torch.optim.SGD, lr=0.1)
SCRIPTS = pathlib.Path(__file__).parent / "trainer_scripts"


class Blobs(Dataset):  # type: ignore[type-arg]
    """Two Gaussian blobs in 8 dimensions, labels 0/1; deterministic."""

    def __init__(self, length: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.targets = torch.randint(0, 2, (length,), generator=generator)
        self.data = torch.randn(length, 8, generator=generator) + self.targets[:, None].float()

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[index], self.targets[index]

    def __len__(self) -> int:
        return len(self.targets)


class Net(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(dropout), nn.Linear(16, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class TargetNet(Net):
    """nanoGPT's convention: ``forward(idx, targets=None) -> (logits, loss)``."""

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> Any:  # type: ignore[override]
        logits = self.net(x)
        loss = None if targets is None else CE(logits, targets)
        return logits, loss


class DictNet(Net):
    """Hugging Face's convention: dict batches, ``forward(**batch)`` returns a dict with ``loss``."""

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor | None = None) -> Any:  # type: ignore[override]
        logits = self.net(inputs)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = CE(logits, labels)
        return out


class DictBlobs(Blobs):
    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return {"inputs": self.data[index], "labels": self.targets[index]}


def quiet(tmp: str, **kwargs: Any) -> Trainer:
    options: dict[str, Any] = {
        "default_root_dir": tmp,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "batch_size": 16,
    }
    options.update(kwargs)
    return Trainer(**options)


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def exact_metrics(model: nn.Module, data: Blobs) -> dict[str, float]:
    with torch.no_grad():
        out = model(data.data)
        out = out[0] if isinstance(out, tuple) else out
        return {
            "loss": CE(out, data.targets).item(),
            "acc": (out.argmax(1) == data.targets).float().mean().item(),
        }


# --------------------------------------------------------------------------------------------------
# val_check_interval


class RecordValidation(Callback):
    def __init__(self) -> None:
        self.steps: list[int] = []
        self.losses: list[float] = []

    def on_validation_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        self.steps.append(trainer.global_step)
        self.losses.append(metrics["val_loss"])


def validation_every_n_steps(tmp: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Net()
    record = RecordValidation()
    val = Blobs(37, seed=1)
    # 200 samples, 2 ranks, batch 16: 7 steps per epoch; validation at 4, 7 (epoch end), 8, 12, 14.
    trainer = quiet(tmp, strategy="ddp", max_epochs=2, val_check_interval=4, callbacks=[record])
    trainer.fit(
        model,
        Blobs(200),
        val,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        loss_fn=CE,
    )
    return {"steps": record.steps, "last": record.losses[-1], "exact": exact_metrics(model, val)["loss"]}


def test_val_check_interval_validates_mid_epoch_and_never_twice_at_one_step(ranks, tmp_path) -> None:
    for result in ranks.run(validation_every_n_steps, str(tmp_path)):
        assert result["steps"] == [4, 7, 8, 12, 14]
        assert result["last"] == pytest.approx(result["exact"], rel=1e-5)


def resumable_run(tmp: str, max_steps: int, resume: bool) -> torch.Tensor:
    torch.manual_seed(0)
    model = Net(dropout=0.3)
    val = Blobs(48, seed=1)
    # A plain DataLoader draws its iterator's base seed from the global generator: validation
    # moves the training process's random streams, so a checkpoint saved before it would resume
    # a different run.
    val_loader = DataLoader(val, batch_size=8, shuffle=True)
    trainer = quiet(
        tmp,
        strategy="ddp",
        max_steps=max_steps,
        val_check_interval=3,
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(every_n_steps=3, every_n_epochs=0, keep_last=5)],
        resume="auto" if resume else None,
        seed=7,
    )
    trainer.fit(
        model,
        Blobs(200),
        val_loader,
        optimizer=torch.optim.Adam(model.parameters(), 1e-2),
        loss_fn=CE,
    )
    return flat(model)


def test_validation_mid_epoch_keeps_a_resumed_run_bitwise_equal_to_an_uninterrupted_one(
    ranks, tmp_path
) -> None:
    whole = ranks.run(resumable_run, str(tmp_path / "whole"), 11, False)
    ranks.run(resumable_run, str(tmp_path / "cut"), 6, False)  # stops at a checkpointed, validated step
    resumed = ranks.run(resumable_run, str(tmp_path / "cut"), 11, True)
    for want, got in zip(whole, resumed, strict=True):
        assert torch.equal(want, got)


# --------------------------------------------------------------------------------------------------
# validate / test / predict under the pool (torchrun-like ranks)


def evaluate_on_ranks(tmp: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Net()
    data = Blobs(101, seed=3)  # 51 + 50: uneven, never padded
    trainer = quiet(tmp, strategy="ddp", val_batch_size=8, max_epochs=1)
    val = trainer.validate(model, data, loss_fn=CE, metrics={"acc": accuracy})
    test = trainer.test(model, data, loss_fn=CE)
    main_only = trainer.predict(model, data)
    everywhere = trainer.predict(model, data, all_ranks=True)
    with torch.no_grad():
        want = model(data.data)
    return {
        "val": val,
        "test": test,
        "exact": exact_metrics(model, data),
        "main_only": main_only,
        "everywhere": everywhere,
        "want": want,
        "rank": distkit.get_rank(),
    }


def evaluate_one_sample_a_batch(tmp: str) -> tuple[dict[str, float], dict[str, float], list[str]]:
    import warnings

    torch.manual_seed(0)
    model = Net()
    data = Blobs(101, seed=3)  # 51 + 50 batches of one: an uneven count
    trainer = quiet(tmp, strategy="ddp", val_batch_size=1, max_epochs=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        val = trainer.validate(model, data, loss_fn=CE, metrics={"acc": accuracy})
        trainer.predict(model, data)
    return val, exact_metrics(model, data), [str(w.message) for w in caught]


def test_evaluation_one_sample_a_batch_on_uneven_ranks_is_exact_and_not_warned_about(ranks, tmp_path) -> None:
    # Was: the loader's warning for a user's own loop ("a collective inside the loop would wait
    # forever"), which the Trainer's evaluation, without a collective per batch, has no use for.
    for val, exact, warned in ranks.run(evaluate_one_sample_a_batch, str(tmp_path)):
        assert val["val_loss"] == pytest.approx(exact["loss"], rel=1e-5)
        assert not [text for text in warned if "batch_size=1" in text], warned


def test_validate_test_and_predict_are_exact_every_sample_once_in_dataset_order(ranks, tmp_path) -> None:
    for result in ranks.run(evaluate_on_ranks, str(tmp_path)):
        exact = result["exact"]
        assert result["val"]["val_loss"] == pytest.approx(exact["loss"], rel=1e-5)
        assert result["val"]["val_acc"] == pytest.approx(exact["acc"], abs=1e-7)
        assert result["test"] == {"test_loss": pytest.approx(exact["loss"], rel=1e-5)}
        assert torch.allclose(result["everywhere"], result["want"], atol=1e-6)
        if result["rank"] == 0:
            assert torch.allclose(result["main_only"], result["want"], atol=1e-6)
        else:
            assert result["main_only"] is None


def fsdp_fit_then_validate(tmp: str) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    torch.manual_seed(0)
    model = Net()
    data = Blobs(64, seed=3)
    trainer = quiet(tmp, strategy="fsdp", max_steps=3)
    trainer.fit(model, Blobs(200), optimizer=lambda p: torch.optim.SGD(p, 0.1), loss_fn=CE)
    got = trainer.validate(model, data, loss_fn=CE)
    predicted = trainer.predict(model, data, all_ranks=True)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    plain = Net()
    plain.load_state_dict(full)
    with torch.no_grad():
        want = plain(data.data)
    return {
        "got": got["val_loss"],
        "exact": exact_metrics(plain, data)["loss"],
        "pred": predicted,
        "want": want,
    }


def test_validate_and_predict_after_an_fsdp_fit_run_on_the_sharded_model(ranks, tmp_path) -> None:
    for result in ranks.run(fsdp_fit_then_validate, str(tmp_path)):
        assert result["got"] == pytest.approx(result["exact"], rel=1e-5)
        assert torch.allclose(result["pred"], result["want"], atol=1e-5)


# --------------------------------------------------------------------------------------------------
# One process, from a checkpoint path, and self-launch


def test_validate_and_predict_load_the_weights_of_a_checkpoint_path_without_fit(tmp_path) -> None:
    torch.manual_seed(0)
    model = Net()
    trainer = quiet(str(tmp_path), max_epochs=1, enable_checkpointing=True)
    trainer.fit(model, Blobs(64), optimizer=lambda p: torch.optim.SGD(p, 0.5), loss_fn=CE)
    (path,) = [str(p) for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("step")]
    data = Blobs(30, seed=5)
    fresh = Net()  # other weights until the checkpoint is loaded
    metrics = quiet(str(tmp_path / "eval"), max_epochs=1).validate(fresh, data, ckpt_path=path, loss_fn=CE)
    assert metrics["val_loss"] == pytest.approx(exact_metrics(model, data)["loss"], rel=1e-6)
    assert torch.equal(flat(fresh), flat(model))
    predicted = quiet(str(tmp_path / "eval"), max_epochs=1).predict(Net(), data, ckpt_path=path)
    with torch.no_grad():
        assert torch.allclose(predicted, model(data.data))


def test_self_launched_validate_and_predict_equal_one_process_over_the_whole_set(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "RANK", "WORLD_SIZE"))}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO / "src"), str(pathlib.Path(__file__).parent), env.get("PYTHONPATH", "")]
    )
    out = tmp_path / "result.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / "evaluate_job.py"), str(tmp_path), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    print(result.stdout[-3000:], result.stderr[-5000:], sep="\n")
    assert result.returncode == 0
    got = json.loads(out.read_text())
    assert got["world_size_seen"] == 2  # the metrics came from two launched processes
    assert got["val_loss"] == pytest.approx(got["exact_loss"], rel=1e-5)
    assert got["val_acc"] == pytest.approx(got["exact_acc"], abs=1e-7)
    assert got["predict_matches"] is True and got["predict_rows"] == 101


# --------------------------------------------------------------------------------------------------
# Models whose forward takes the target


def hand_loop(model: nn.Module, data: Blobs, steps: int) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    loader = distkit.distributed_dataloader(data, 16, seed=0)
    for _, (x, y) in zip(range(steps), loader, strict=False):
        loss = CE(model(x)[0] if isinstance(model, TargetNet) else model(x), y)
        losses.append(loss.item())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return losses


class RecordLoss(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_step_end(self, trainer: Trainer, loss: torch.Tensor) -> None:
        self.losses.append(loss.item())


@pytest.mark.parametrize("kind", ["targets-kwarg", "dict-batches"])
def test_a_model_that_computes_its_own_loss_trains_like_the_hand_loop(kind, tmp_path) -> None:
    torch.manual_seed(0)
    reference = Net()
    want = hand_loop(reference, Blobs(96), 6)
    model: nn.Module = TargetNet() if kind == "targets-kwarg" else DictNet()
    model.load_state_dict(_initial_net_state())
    data = Blobs(96) if kind == "targets-kwarg" else DictBlobs(96)
    record = RecordLoss()
    trainer = quiet(str(tmp_path), max_steps=6, callbacks=[record], seed=0)  # the hand loop's loader seed
    val = Blobs(20, seed=1) if kind == "targets-kwarg" else DictBlobs(20, seed=1)
    trainer.fit(model, data, val, optimizer=lambda p: torch.optim.SGD(p, 0.1))
    assert record.losses == want
    assert torch.equal(flat(model), flat(reference))
    assert trainer.callback_metrics["val_loss"] == pytest.approx(
        exact_metrics(reference, Blobs(20, seed=1))["loss"], rel=1e-5
    )


def _initial_net_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return Net().state_dict()


class LogitsOnly(Net):
    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        return self.net(x)


def test_a_forward_taking_the_target_but_returning_no_loss_names_what_was_looked_for(tmp_path) -> None:
    with pytest.raises(DistkitError, match=r"returned no loss.*training_step"):
        quiet(str(tmp_path), max_steps=1).fit(
            LogitsOnly(), Blobs(32), optimizer=lambda p: torch.optim.SGD(p, 0.1)
        )


def test_a_loss_fn_that_fails_on_the_first_batch_points_to_training_step_with_an_example(tmp_path) -> None:
    def wrong_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(output, target)  # (16, 2) against (16,): torch's shape error

    with pytest.raises(DistkitError) as caught:
        quiet(str(tmp_path), max_steps=1).fit(
            Net(), Blobs(32), optimizer=lambda p: torch.optim.SGD(p, 0.1), loss_fn=wrong_loss
        )
    message = str(caught.value)
    assert "failed on the first batch (tensor (16, 8) float32, tensor (16,) int64)" in message
    # Where first (loss_fn, given the model's output), and only then the guess.
    where = (
        "The exception was raised in loss_fn, after the model's forward had returned tensor (16, 2) float32"
    )
    assert where in message and message.index(where) < message.index("Likely cause (a guess")
    assert "def training_step(self, batch, batch_idx):" in message and "targets" in message
    assert isinstance(caught.value.__cause__, (RuntimeError, ValueError))


def test_a_plain_model_without_loss_fn_or_target_parameter_is_refused_at_once(tmp_path) -> None:
    with pytest.raises(
        ValueError, match=r"no loss_fn was given.*targets, target, labels, label.*training_step"
    ):
        quiet(str(tmp_path), max_steps=1).fit(Net(), Blobs(32), optimizer=lambda p: torch.optim.SGD(p, 0.1))


def test_inputs_and_targets_given_as_a_tuple_of_tensors_are_refused_naming_tensordataset(tmp_path) -> None:
    # Keras's fit(x, y) habit: as a dataset, (x, y) is two samples, the tensors themselves.
    x, y = torch.randn(32, 8), torch.randint(0, 2, (32,))
    trainer = quiet(str(tmp_path), max_steps=1)
    expected = r"is a tuple of 2 tensors \(\(32, 8\), \(32,\)\): as a dataset that is 2 samples"
    with pytest.raises(TypeError, match=expected + r".*TensorDataset\(\*train_data\) for its 32 rows"):
        trainer.fit(
            Net(), (x, y), optimizer=lambda p: torch.optim.SGD(p, 0.1), loss_fn=nn.functional.cross_entropy
        )
    with pytest.raises(TypeError, match=r"val_data is a tuple of 2 tensors"):
        trainer.fit(
            Net(),
            Blobs(32),
            (x, y),
            optimizer=lambda p: torch.optim.SGD(p, 0.1),
            loss_fn=nn.functional.cross_entropy,
        )
    for call in (trainer.validate, trainer.test):
        with pytest.raises(TypeError, match=expected + r".*TensorDataset\(\*data\)"):
            call(Net(), (x, y), loss_fn=nn.functional.cross_entropy)
    with pytest.raises(TypeError, match=expected):
        trainer.predict(Net(), (x, y))
    assert trainer.global_step == 0 and not (tmp_path / "checkpoints").exists()


def test_a_loss_class_given_as_loss_fn_is_refused_naming_the_instance_to_pass(tmp_path) -> None:
    # loss_fn=nn.CrossEntropyLoss would build a module from (output, target) and fail on the first
    # batch with "Boolean value of Tensor with more than one value is ambiguous".
    with pytest.raises(
        TypeError,
        match=r"loss_fn=torch\.nn\.CrossEntropyLoss is a class: pass an instance, "
        r"loss_fn=torch\.nn\.CrossEntropyLoss\(\)",
    ):
        quiet(str(tmp_path), max_steps=1).fit(
            Net(), Blobs(32), optimizer=lambda p: torch.optim.SGD(p, 0.1), loss_fn=nn.CrossEntropyLoss
        )
    assert not (tmp_path / "checkpoints").exists()  # refused before anything started


# --------------------------------------------------------------------------------------------------
# Schedules in epochs, the scheduler factory, and the report's learning rates


class RecordLR(Callback):
    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_train_step_end(self, trainer: Trainer, loss: torch.Tensor) -> None:
        # The rate the step just taken used: the scheduler has already stepped, so read its last.
        self.lrs.append(trainer.lr_scheduler.get_last_lr()[0])


def test_warmup_in_epochs_uses_steps_per_epoch_known_before_the_scheduler_is_made(tmp_path) -> None:
    seen: dict[str, int] = {}

    def factory(optimizer: torch.optim.Optimizer, trainer: Trainer) -> Any:
        seen["steps_per_epoch"], seen["total_steps"] = trainer.steps_per_epoch, trainer.total_steps
        return warmup_schedule(warmup_epochs=1, decay="linear")(optimizer, trainer)

    record = RecordLR()
    trainer = quiet(str(tmp_path), max_epochs=3, callbacks=[record])
    trainer.fit(
        Net(),
        Blobs(96),
        optimizer=lambda p: torch.optim.SGD(p, 0.6),
        lr_scheduler=factory,
        loss_fn=CE,
    )
    assert seen == {"steps_per_epoch": 6, "total_steps": 18}
    # After step k (1-based) the scheduler holds the rate of step k+1: warm-up (k+1)/6, then
    # linear decay over the remaining 12 steps to 0.
    want = [0.6 * min(k + 1, 6) / 6 if k < 6 else 0.6 * (1 - (k - 6) / 12) for k in range(1, 19)]
    assert record.lrs == pytest.approx(want)


def report_of(tmp: str, **kwargs: Any) -> str:
    out = io.StringIO()
    with redirect_stdout(out):
        trainer = quiet(tmp, enable_checkpointing=True, **kwargs)
        trainer.fit(
            Net(),
            Blobs(64),
            optimizer=SGD01,
            lr_scheduler=warmup_schedule(warmup_steps=4, decay="constant"),
            loss_fn=CE,
        )
    return next(line for line in out.getvalue().splitlines() if "learning rate" in line)


def test_the_report_shows_base_and_scaled_rates_not_the_warmups_first_also_after_resume(
    tmp_path,
) -> None:
    first = report_of(str(tmp_path), max_steps=2, scale_lr="linear", base_batch_size=8)
    assert "0.1 base, scaled x2 (linear: 16 effective batch / 8 base) -> 0.2" in first
    assert "0.05 at step 0 (schedule)" in first  # warm-up's first step: 0.2 x 1/4
    again = report_of(str(tmp_path), max_steps=3, scale_lr="linear", base_batch_size=8, resume="auto")
    assert "0.1 base, scaled x2 (linear: 16 effective batch / 8 base) -> 0.2" in again
    assert "0.15 at step 2 (schedule)" in again


def scaled_on_two_ranks(tmp: str) -> float:
    torch.manual_seed(0)
    model = Net()
    trainer = quiet(
        tmp,
        strategy="ddp",
        max_steps=2,
        scale_lr="linear",
        base_batch_size=16,
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(every_n_steps=2, every_n_epochs=0)],
    )
    trainer.fit(
        model,
        Blobs(96),
        optimizer=SGD01,
        loss_fn=CE,
    )
    return trainer.optimizer.param_groups[0]["lr"]


def test_a_resume_on_another_number_of_ranks_rescales_the_learning_rate(ranks, tmp_path) -> None:
    assert ranks.run(scaled_on_two_ranks, str(tmp_path)) == [pytest.approx(0.2)] * 2  # 2 ranks x 16 / 16
    trainer = quiet(
        str(tmp_path),
        max_steps=3,
        scale_lr="linear",
        base_batch_size=16,
        enable_checkpointing=True,
        resume="auto",
    )
    trainer.fit(
        Net(),
        Blobs(96),
        optimizer=SGD01,
        loss_fn=CE,
    )
    assert trainer.global_step == 3
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.1)  # one process: x1


# --------------------------------------------------------------------------------------------------
# Per-rank randomness


class FirstDraw(Callback):
    """Takes one draw from the global generator at the start of fit (after the Trainer seeded it)."""

    def __init__(self) -> None:
        self.draw: float | None = None
        self.loader_seed: int | None = None

    def on_fit_start(self, trainer: Trainer) -> None:
        self.draw = torch.rand(()).item()
        self.loader_seed = trainer._shown.train_loader.seed  # the loader fit made (the run state)


class SeenBlobs(Blobs):
    """Blobs that list the indices read (DataLoader without workers: in this process)."""

    def __init__(self, length: int) -> None:
        super().__init__(length)
        self.seen: list[int] = []

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.seen.append(index)
        return super().__getitem__(index)


def draws_with(tmp: str, per_rank: bool) -> tuple[float | None, int | None, list[int]]:
    record = FirstDraw()
    data = SeenBlobs(64)
    trainer = quiet(tmp, strategy="ddp", max_steps=2, seed=5, seed_per_rank=per_rank, callbacks=[record])
    trainer.fit(Net(), data, optimizer=SGD01, loss_fn=CE)
    return record.draw, record.loader_seed, data.seen


def test_seed_per_rank_gives_each_rank_its_own_streams_and_keeps_the_common_data_order(
    ranks, tmp_path
) -> None:
    common = ranks.run(draws_with, str(tmp_path / "common"), False)
    own = ranks.run(draws_with, str(tmp_path / "own"), True)
    assert common[0][0] == common[1][0]  # one stream for all without per_rank
    assert own[0][0] != own[1][0]  # each rank its own with it
    assert [r[1] for r in own] == [5, 5]  # the loaders keep the common seed...
    assert [r[2] for r in own] == [r[2] for r in common]  # ...and so the same data order
    assert ranks.run(draws_with, str(tmp_path / "again"), True) == own  # derived, not random


def test_a_step_checkpoint_at_a_validated_step_is_ranked_by_the_monitored_metric(tmp_path) -> None:
    record = RecordValidation()
    checkpoint = ModelCheckpoint(
        every_n_steps=2, every_n_epochs=0, monitor="val_loss", keep_last=1, keep_best=1, every_n_minutes=None
    )
    trainer = quiet(
        str(tmp_path),
        max_steps=8,
        val_check_interval=2,
        enable_checkpointing=True,
        callbacks=[record, checkpoint],
    )
    # A learning rate that overshoots: val_loss does not fall monotonically, so the best step is not the last.
    trainer.fit(Net(), Blobs(64), Blobs(32, seed=1), optimizer=lambda p: torch.optim.SGD(p, 3.0), loss_fn=CE)
    best_step = record.steps[min(range(len(record.losses)), key=record.losses.__getitem__)]
    assert record.steps == [2, 4, 6, 8]
    assert checkpoint.manager.best().endswith(f"step_{best_step:09d}")


class StepNet(Net):
    """A model with its own test_step and predict_step."""

    def test_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x, y = batch
        correct = (self(x).argmax(1) == y).sum()
        return {"test_correct": (correct, len(y))}

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        return self(x).argmax(1)


def test_test_and_predict_use_the_models_own_steps_when_it_has_them(tmp_path) -> None:
    torch.manual_seed(0)
    model, data = StepNet(), Blobs(50, seed=2)
    trainer = quiet(str(tmp_path), max_epochs=1, val_batch_size=8)
    got = trainer.test(model, data)
    with torch.no_grad():
        labels = model(data.data).argmax(1)
    assert got == {"test_correct": pytest.approx((labels == data.targets).float().mean().item())}
    assert torch.equal(trainer.predict(model, data), labels)
    with pytest.raises(ValueError, match="Net gives no val metric: pass loss_fn"):
        trainer.validate(Net(), data)  # no loss_fn, no validation_step, no target parameter


class ValidationStepOnly(Net):
    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x, y = batch
        return {"val_correct": ((self(x).argmax(1) == y).sum(), len(y)), "seen": (len(y), len(y))}


def test_test_through_a_validation_step_names_its_metrics_test_and_keeps_the_validations(tmp_path) -> None:
    """Was: {'val_correct': ...} from test(), overwriting the validation's val_correct in
    trainer.callback_metrics."""
    torch.manual_seed(0)
    model = ValidationStepOnly()
    trainer = quiet(str(tmp_path), max_epochs=1, val_batch_size=8)
    validated = trainer.validate(model, Blobs(50, seed=1))
    tested = trainer.test(model, Blobs(50, seed=2))
    assert sorted(validated) == ["seen", "val_correct"] and sorted(tested) == ["seen", "test_correct"]
    assert trainer.callback_metrics["val_correct"] == validated["val_correct"]
    assert trainer.callback_metrics["test_correct"] == tested["test_correct"]


class TrainingStepOnly(Net):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return CE(self(x), y)


def test_validate_of_a_model_with_only_a_training_step_says_what_it_needs(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"training_step is not used here\. Pass loss_fn"):
        quiet(str(tmp_path), max_epochs=1).validate(TrainingStepOnly(), Blobs(20))
