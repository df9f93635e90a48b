"""Progress a batch job's log can show, and checkpoints by time, on real runs: a Trainer whose stderr
is a file or a terminal (a pty), 2-rank DDP under gloo, real checkpoints resumed."""

from __future__ import annotations

import contextlib
import csv
import fcntl
import io
import itertools
import os
import pathlib
import pty
import re
import select
import statistics
import struct
import subprocess
import sys
import termios
import time

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import distkit
from distkit.trainer import Callback, ModelCheckpoint, Trainer, callbacks as callbacks_module
from distkit.trainer.progress import ProgressLog, _default_progress, _ProgressBar

SCRIPTS = pathlib.Path(__file__).parent / "trainer_scripts"
REPO = pathlib.Path(__file__).parent.parent

# One plain progress line of a step: "step 4/15 | epoch 0 | loss 2.3098 | 1,814.6 samples/s | ..."
STEP_LINE = re.compile(
    r"^step (?P<step>\d+)/(?P<total>\d+) \| epoch (?P<epoch>\d+) \| "
    r"loss (?P<loss>\d+\.\d{4})(?P<rank> \(rank 0\))? \| (?P<rate>[\d,]+\.\d) samples/s \| "
    r"elapsed \d+:\d\d:\d\d( \| ETA \d+:\d\d:\d\d)?$"
)
# What tqdm draws: "epoch 0:  40%|████      | 4/10 [00:00<00:00, 52.1it/s]".
TQDM_FRAME = re.compile(r"\d+%\|.*\| *\d+/\d+ \[")


def data(samples: int = 320) -> TensorDataset:
    generator = torch.Generator().manual_seed(1234)
    return TensorDataset(
        torch.randn(samples, 20, generator=generator), torch.randint(0, 10, (samples,), generator=generator)
    )


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 10))


def flat_weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def job_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "RANK", "WORLD_SIZE"))}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])
    return env


# --------------------------------------------------------------------------------------------------
# Plain lines in a log file, the tqdm bar in a terminal


def test_a_two_rank_job_logging_to_a_file_gets_plain_lines_from_the_main_process_only(tmp_path) -> None:
    # `python progress_job.py` starts 2 DDP workers that inherit its stderr, here a file as under
    # SLURM. A ProgressLog every 2 steps is given, so the Trainer adds no second one; rank 1 runs
    # it too and must print nothing. 5 steps per epoch, logging every 4: the lines at steps 4, 8
    # and 12 carry the job's reduced loss (the one metrics.csv holds), the others rank 0's own.
    stderr_path = tmp_path / "stderr.log"
    with open(stderr_path, "w") as stderr:
        result = subprocess.run(
            [sys.executable, str(SCRIPTS / "progress_job.py"), str(tmp_path), "ddp", "2", "--every", "2"],
            env=job_env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            timeout=240,
        )
    log = stderr_path.read_text()
    print(result.stdout[-3000:], log[-6000:], sep="\n")  # shown by pytest on failure
    assert result.returncode == 0
    assert "\r" not in log and not TQDM_FRAME.search(log) and "it/s" not in log

    lines = [line for line in log.splitlines() if line.startswith(("step ", "epoch ", "fit ended"))]
    steps = [STEP_LINE.match(line) for line in lines if line.startswith("step ")]
    assert all(steps), lines
    assert [int(m["step"]) for m in steps] == [2, 4, 6, 8, 10, 12, 14]  # once each: rank 1 is silent
    assert {int(m["total"]) for m in steps} == {15}
    assert [int(m["epoch"]) for m in steps] == [0, 0, 1, 1, 1, 2, 2]
    assert all(float(m["rate"].replace(",", "")) > 0 for m in steps)
    assert all(" | ETA " in m[0] for m in steps)  # steps are left after each of them
    with open(tmp_path / "metrics.csv", newline="") as handle:
        logged = {
            int(row["step"]): float(row["train_loss"]) for row in csv.DictReader(handle) if row["train_loss"]
        }
    assert sorted(logged) == [4, 8, 12]
    for m in steps:
        step = int(m["step"])
        if step in logged:
            assert m["rank"] is None and m["loss"] == f"{logged[step]:.4f}", m[0]
        else:
            assert m["rank"] == " (rank 0)", m[0]

    epochs = [line for line in lines if line.startswith("epoch ")]
    assert [line.split(" | ")[:2] for line in epochs] == [
        ["epoch 0 end", "step 5/15"],
        ["epoch 1 end", "step 10/15"],
        ["epoch 2 end", "step 15/15"],
    ]
    assert all(re.search(r"\| val_loss \d+\.\d{4} \|", line) for line in epochs), epochs
    assert all(re.search(r"\| train_loss_epoch \d+\.\d{4} \|", line) for line in epochs), epochs
    assert [line for line in lines if line.startswith("fit ended")] == [lines[-1]]
    assert lines[-1].startswith("fit ended at step 15 after ")


def read_terminal(master: int, proc: subprocess.Popen[bytes], timeout_s: float) -> bytes:
    """Everything written to the pty until the process exits and the pty is drained."""
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        readable, _, _ = select.select([master], [], [], 0.5)
        if readable:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the last writer closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
        elif proc.poll() is not None:
            break
    else:
        proc.kill()
        raise AssertionError(f"the job did not finish within {timeout_s} s")
    proc.wait(timeout=30)
    return b"".join(chunks)


def test_in_a_terminal_the_default_stays_the_tqdm_bar(tmp_path) -> None:
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    try:
        proc = subprocess.Popen(
            [sys.executable, str(SCRIPTS / "progress_job.py"), str(tmp_path), "single", "1"],
            env=job_env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=slave,
        )
        os.close(slave)
        slave = -1
        screen = read_terminal(master, proc, 240).decode(errors="replace")
    finally:
        os.close(master)
        if slave >= 0:
            os.close(slave)
    print(screen[-6000:])
    assert proc.returncode == 0
    assert TQDM_FRAME.search(screen) and "epoch 2:" in screen  # a bar per epoch, as before
    # Each bar ends full: the Trainer moves it every few steps (the steps since at once), and at
    # the epoch's end to its last step.
    for epoch in range(3):
        assert re.search(rf"epoch {epoch}: 100%\|[^\r\n]*\| 10/10 \[", screen), epoch
    assert "samples/s" not in screen and "fit ended" not in screen  # no ProgressLog beside it


def default_run(directory: pathlib.Path, samples: int = 320, **kwargs: object) -> Trainer:
    options: dict[str, object] = {
        "strategy": "single",
        "max_epochs": 2,
        "batch_size": 64,
        "default_root_dir": directory,
        "logger": False,
        "enable_checkpointing": False,
        **kwargs,
    }
    trainer = Trainer(**options)  # type: ignore[arg-type]
    trainer.fit(
        small_model(),
        data(samples),
        data(64),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        loss_fn=nn.functional.cross_entropy,
    )
    return trainer


def test_by_default_a_log_file_gets_plain_epoch_lines_and_enable_progress_bar_false_prints_none(
    tmp_path,
) -> None:
    # stderr is a file: the Trainer picks ProgressLog itself (30 s apart: this run only ends epochs).
    for name, kwargs in (("default", {}), ("off", {"enable_progress_bar": False})):
        path = tmp_path / f"{name}.log"
        with open(path, "w") as log, contextlib.redirect_stderr(log):
            default_run(tmp_path / name, **kwargs)
        text = path.read_text()
        lines = [line for line in text.splitlines() if line.startswith(("step ", "epoch ", "fit ended"))]
        if name == "off":
            assert lines == [], text
            continue
        assert "\r" not in text and not TQDM_FRAME.search(text)
        assert [line.split(" | ")[:2] for line in lines[:2]] == [
            ["epoch 0 end", "step 5/10"],
            ["epoch 1 end", "step 10/10"],
        ]
        assert "val_loss" in lines[0] and " | ETA " in lines[0] and " | ETA " not in lines[1]
        assert lines[2].startswith("fit ended at step 10 after ") and len(lines) == 3


class Sleep(Callback):
    """Makes every optimizer step (on the main process, or on every rank) last at least `seconds`."""

    def __init__(self, seconds: float, main_only: bool = False) -> None:
        self.seconds, self.main_only = seconds, main_only

    def on_train_step_end(self, trainer: Trainer, loss: torch.Tensor) -> None:
        if not self.main_only or trainer.is_main_process:
            time.sleep(self.seconds)


def test_progress_lines_come_every_interval_s_or_every_n_steps(tmp_path) -> None:
    # Steps of at least 60 ms: a 50 ms interval is due after every step, an hour's never is.
    # 5 steps per epoch, 10 in all, a log every 2 steps (the lines there wait for its reduction).
    cases = {
        "every step by time": ({"interval_s": 0.05}, list(range(1, 11))),
        "an hour": ({"interval_s": 3600.0}, []),
        "every 3 steps": ({"every_n_steps": 3, "interval_s": None}, [3, 6, 9]),
    }
    for name, (options, want) in cases.items():
        out = io.StringIO()
        default_run(
            tmp_path / name.replace(" ", "_"),
            log_every_n_steps=2,
            callbacks=[Sleep(0.06), ProgressLog(**options, stream=out)],  # type: ignore[arg-type]
        )
        steps = [STEP_LINE.match(line) for line in out.getvalue().splitlines() if line.startswith("step ")]
        assert all(steps), out.getvalue()
        assert [int(m["step"]) for m in steps] == want, name
        assert all(m["rank"] is None for m in steps)  # one process: its loss is the job's
        epochs = [line for line in out.getvalue().splitlines() if line.startswith("epoch ")]
        assert [line.split(" | ")[0] for line in epochs] == ["epoch 0 end", "epoch 1 end"]


class StepCounter(Callback):
    """The steps at which the Trainer calls its step-end hook: a user's callback, so every step."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_train_step_end(self, trainer: Trainer, loss: torch.Tensor) -> None:
        self.steps.append(trainer.global_step)


class EveryStepCheckpoint(ModelCheckpoint):
    """A subclass that overrides the step-end hook: the Trainer cannot know when it acts."""

    def __init__(self, dirpath: pathlib.Path) -> None:
        super().__init__(dirpath, every_n_steps=7, every_n_minutes=None)
        self.steps: list[int] = []

    def on_train_step_end(self, trainer: Trainer, loss: torch.Tensor) -> None:
        self.steps.append(trainer.global_step)
        super().on_train_step_end(trainer, loss)


def hook_calls(callback: Callback) -> list[int]:
    """The steps at which the Trainer calls ``callback``'s own step-end hook (wrapped on the instance:
    the Trainer still sees its class's hook, and schedules it)."""
    calls: list[int] = []
    own = callback.on_train_step_end

    def counted(trainer: Trainer, loss: torch.Tensor) -> None:
        calls.append(trainer.global_step)
        own(trainer, loss)

    callback.on_train_step_end = counted  # type: ignore[method-assign]
    return calls


def saved_steps(checkpoint: ModelCheckpoint) -> list[int]:
    """The steps at which ``checkpoint`` saves (its ``save`` wrapped on the instance)."""
    steps: list[int] = []
    own = checkpoint.save

    def counted(trainer: Trainer, metrics: dict[str, float] | None = None) -> None:
        steps.append(trainer.global_step)
        own(trainer, metrics)

    checkpoint.save = counted  # type: ignore[method-assign]
    return steps


def fast_fit(directory: pathlib.Path, callbacks: list[Callback], samples: int = 300) -> None:
    """Fast steps (one sample a batch, two epochs: 600 by default), a log every 50."""
    default_run(directory, samples, batch_size=1, log_every_n_steps=50, callbacks=callbacks)


def test_the_trainer_calls_its_own_step_end_callbacks_only_at_the_steps_they_act(tmp_path) -> None:
    # The progress line by time and the checkpoint by steps are called at the steps they name
    # (issue 29: nothing to do at most steps costs nothing), and still print and save as before; a
    # user's callback, and a subclass that overrides the hook, are called at every step.
    # An hour's interval: the clock is read every 64 steps, and at the other callbacks' steps.
    progress = ProgressLog(interval_s=3600.0)
    plain = ModelCheckpoint(tmp_path / "plain", every_n_steps=7, every_n_minutes=None)
    progress_calls, plain_calls, plain_saves = hook_calls(progress), hook_calls(plain), saved_steps(plain)
    counter = StepCounter()
    fast_fit(tmp_path / "plain", [progress, plain, counter])
    subclass = EveryStepCheckpoint(tmp_path / "subclass")
    subclass_saves = saved_steps(subclass)
    fast_fit(tmp_path / "subclass", [subclass])

    every_step = list(range(1, 601))
    assert counter.steps == subclass.steps == every_step
    sevens = list(range(7, 601, 7))
    # Saved at every multiple of 7 and at the two epochs' ends, by the plain callback and the subclass alike.
    assert plain_saves == subclass_saves == sorted({*sevens, 300, 600})
    # Called at the multiples of 7, of 50 (logging) and at the progress line's clock reads (< 20).
    assert set(sevens) | set(range(50, 601, 50)) <= set(plain_calls), plain_calls
    assert len(plain_calls) < 85 + 12 + 20, plain_calls
    assert len(progress_calls) < 85 + 12 + 20, progress_calls

    # 4,000 fast steps and a short interval: a line by time comes at most a twentieth of the interval
    # late while the step rate holds (a busy machine's pauses aside: the median gap between lines).
    interval_s = 0.05
    out = TimedStream()
    fast_fit(tmp_path / "timed", [ProgressLog(interval_s=interval_s, stream=out)], samples=2000)  # type: ignore[arg-type]
    lines = [(when, line) for when, line in out.lines if line.startswith("step ")]
    assert all(STEP_LINE.match(line) for _, line in lines), out.lines
    gaps = [later[0] - earlier[0] for earlier, later in itertools.pairwise(lines)]
    assert len(gaps) >= 5 and statistics.median(gaps) <= 1.25 * interval_s, gaps


class TimedStream:
    """A stream that keeps each line written with the time it came."""

    def __init__(self) -> None:
        self.lines: list[tuple[float, str]] = []

    def write(self, text: str) -> None:
        self.lines.extend((time.monotonic(), line) for line in text.splitlines())

    def flush(self) -> None:
        pass


def test_a_mid_epoch_validation_gets_a_line_of_its_own(tmp_path) -> None:
    # val_check_interval=3: validations at steps 3, 6 and 9; the epochs end at steps 5 and 10.
    out = io.StringIO()
    default_run(tmp_path, val_check_interval=3, callbacks=[ProgressLog(interval_s=3600.0, stream=out)])
    lines = out.getvalue().splitlines()
    validations = [line for line in lines if line.startswith("validation")]
    assert [line.split(" | ")[1:3] for line in validations] == [
        ["step 3/10", "epoch 0"],
        ["step 6/10", "epoch 1"],
        ["step 9/10", "epoch 1"],
    ]
    assert all(re.search(r"\| val_loss \d+\.\d{4} \|", line) for line in validations), validations
    assert [line.split(" | ")[0] for line in lines if line.startswith("epoch ")] == [
        "epoch 0 end",
        "epoch 1 end",
    ]


def test_default_progress_follows_enable_progress_bar_and_whether_stderr_is_a_terminal(
    tmp_path, monkeypatch
) -> None:
    with open(tmp_path / "stderr.log", "w") as log:
        monkeypatch.setattr(sys, "stderr", log)
        assert isinstance(_default_progress(None), ProgressLog)
        assert _default_progress(None, [ProgressLog(every_n_steps=10)]) is None  # the user's instead
        assert isinstance(_default_progress(True), _ProgressBar)  # asked for: even in a file
        assert _default_progress(False) is None
    master, slave = pty.openpty()  # a terminal of no size yet, as CI runners and `script` make
    with os.fdopen(slave, "w") as terminal:
        monkeypatch.setattr(sys, "stderr", terminal)
        # tqdm would draw nothing on a terminal 0 columns wide until the end: plain lines instead.
        assert os.get_terminal_size(terminal.fileno()).columns == 0
        assert isinstance(_default_progress(None), ProgressLog)
        fcntl.ioctl(terminal.fileno(), termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
        assert isinstance(_default_progress(None), _ProgressBar)
        assert _default_progress(False) is None
    os.close(master)


def test_progress_log_and_time_checkpoint_options_are_checked_with_the_value_and_fix() -> None:
    with pytest.raises(ValueError, match=r"every_n_steps or interval_s .* None for both"):
        ProgressLog(every_n_steps=None, interval_s=None)
    with pytest.raises(ValueError, match="interval_s must be a number of seconds > 0 or None, got 0"):
        ProgressLog(interval_s=0)
    with pytest.raises(ValueError, match="every_n_steps must be an int >= 1 or None, got 0"):
        ProgressLog(every_n_steps=0)
    with pytest.raises(ValueError, match=r"every_n_minutes must be a number of minutes > 0 .* got -1"):
        ModelCheckpoint(every_n_minutes=-1)
    # The Trainer drives one checkpoint callback: a second would fail at its first save.
    with pytest.raises(
        ValueError, match=r"2 ModelCheckpoint objects \(directories: 'a', default\).*Keep one"
    ):
        Trainer(callbacks=[ModelCheckpoint("a"), ModelCheckpoint(every_n_minutes=5)])
    # A credential in a checkpoint URL stays out of the message.
    with pytest.raises(ValueError, match=r"directories: 'memory://\*\*\*@bucket/run', 'b'") as refused:
        Trainer(callbacks=[ModelCheckpoint("memory://AKIA:hunter2@bucket/run"), ModelCheckpoint("b")])
    assert "hunter2" not in str(refused.value)
    # The default: a long epoch keeps a checkpoint at most about 30 minutes old.
    assert ModelCheckpoint().every_n_minutes == 30.0
    trainer = Trainer(max_epochs=1, logger=False)
    assert [cb.every_n_minutes for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint)] == [30.0]


# --------------------------------------------------------------------------------------------------
# Checkpoints by time: decided by the main process, saved at the same steps on every rank


class RecordingCheckpoint(ModelCheckpoint):
    """A ModelCheckpoint that keeps the steps it saved, and whose clock on `skewed_rank` is off by
    `skew_s` seconds at the start of fit (as the ranks' clocks of a job may be)."""

    def __init__(self, *, skewed_rank: int | None = None, skew_s: float = 0.0, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.skewed_rank, self.skew_s = skewed_rank, skew_s
        self.saved: list[int] = []

    def on_fit_start(self, trainer: Trainer) -> None:
        super().on_fit_start(trainer)
        if distkit.get_rank() == self.skewed_rank:
            self._last_save_time -= self.skew_s

    def save(self, trainer: Trainer, metrics: dict[str, float] | None = None) -> None:
        self.saved.append(trainer.global_step)
        super().save(trainer, metrics)


class CrashAfter(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_step_end(self, trainer: Trainer, loss: torch.Tensor) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError(f"crash after step {self.step}")


def time_checkpointed_run(
    directory: str, max_steps: int, resume: str | None, crash_after: int | None = None
) -> tuple[list[int], torch.Tensor, str]:
    """2 ranks, 5 steps per epoch, a log every 2 steps; a checkpoint every 0.001 min = 60 ms, and
    every step lasts at least 65 ms on the main process: each logging step's check is due (it is
    made before the step-end callbacks, so one whole step lies between a save and the next check)."""
    model = small_model()
    checkpoint = RecordingCheckpoint(every_n_minutes=0.001, every_n_epochs=0, keep_last=10)
    callbacks: list[Callback] = [Sleep(0.065, main_only=True), checkpoint]
    if crash_after is not None:
        callbacks.insert(0, CrashAfter(crash_after))
    trainer = Trainer(
        strategy="ddp",
        max_steps=max_steps,
        log_every_n_steps=2,
        seed=3,
        resume=resume,
        default_root_dir=directory,
        logger=False,
        enable_progress_bar=False,
        callbacks=callbacks,
    )
    outcome = "finished"
    try:
        trainer.fit(
            model,
            data(),
            optimizer=lambda params: torch.optim.AdamW(params, lr=0.01),
            loss_fn=nn.functional.cross_entropy,
            lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5),
        )
    except RuntimeError as err:
        outcome = str(err)
    return checkpoint.saved, flat_weights(model), outcome


def test_time_checkpoints_save_mid_epoch_at_the_same_steps_on_every_rank_and_resume_exactly(
    ranks, tmp_path
) -> None:
    uninterrupted = ranks.run(time_checkpointed_run, str(tmp_path / "a"), 8, None)
    assert [saved for saved, _, _ in uninterrupted] == [[2, 4, 6, 8]] * 2  # epochs end at 5 and 10

    # "Killed" after step 5, before that epoch's end: the latest checkpoint is step 4, by time.
    crashed = ranks.run(time_checkpointed_run, str(tmp_path / "b"), 8, None, crash_after=5)
    assert [(saved, outcome) for saved, _, outcome in crashed] == [([2, 4], "crash after step 5")] * 2
    assert sorted(p.name for p in (tmp_path / "b" / "checkpoints").iterdir()) == [
        "step_000000002",
        "step_000000004",
    ]
    resumed = ranks.run(time_checkpointed_run, str(tmp_path / "b"), 8, "auto")
    assert [saved for saved, _, _ in resumed] == [[6, 8]] * 2
    # Dropout draws from the restored RNG and step 5 starts mid-epoch: equal only if resumed exactly.
    for (_, want, _), (_, got, _) in zip(uninterrupted, resumed, strict=True):
        assert torch.equal(got, want)


def skewed_clock_run(directory: str, every_n_minutes: float, skew_s: float) -> tuple[list[int], int]:
    """2 ranks, 4 steps, a log every 2; rank 1's clock is off by `skew_s` seconds. Returns the
    saved steps and how many collectives of its own the checkpoint's check made."""
    checkpoint = RecordingCheckpoint(
        skewed_rank=1, skew_s=skew_s, every_n_minutes=every_n_minutes, every_n_epochs=0, keep_last=10
    )
    trainer = Trainer(
        strategy="ddp",
        max_steps=4,
        log_every_n_steps=2,
        default_root_dir=directory,
        logger=False,
        enable_progress_bar=False,
        callbacks=[Sleep(0.065, main_only=True), checkpoint],
    )
    own_checks = []
    any_rank = callbacks_module.any_rank

    def counted(flag: bool) -> bool:
        own_checks.append(flag)
        return any_rank(flag)

    callbacks_module.any_rank = counted  # type: ignore[attr-defined]
    try:
        trainer.fit(
            small_model(),
            data(),
            optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
            loss_fn=nn.functional.cross_entropy,
        )
    finally:
        callbacks_module.any_rank = any_rank  # type: ignore[attr-defined]
    return checkpoint.saved, len(own_checks)


def test_the_main_process_clock_decides_time_checkpoints_when_rank_clocks_disagree(ranks, tmp_path) -> None:
    # Rank 1's clock an hour behind: by its own clock nothing is due, by the main process's every
    # check is (60 ms apart, steps of 65 ms). A decision taken on each rank would leave rank 0
    # saving alone (a hang or a mismatched collective); every rank saves at steps 2 and 4. The
    # question rides on the logging steps' collective of the training metrics: none of its own.
    assert ranks.run(skewed_clock_run, str(tmp_path / "behind"), 0.001, -3600.0) == [([2, 4], 0)] * 2
    # Rank 1's clock an hour ahead, an hour between saves: only rank 1 would think one due.
    assert ranks.run(skewed_clock_run, str(tmp_path / "ahead"), 60.0, 3600.0) == [([], 0)] * 2
    assert not (tmp_path / "ahead" / "checkpoints").exists() or not any(
        (tmp_path / "ahead" / "checkpoints").iterdir()
    )
