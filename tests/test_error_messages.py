"""Issue 23, point 7: errors that point the right way. The first batch's error says where the
exception was raised (the model, ``loss_fn``, the batch) before it guesses; a plain-Trainer resume of
a changed model names the directory, the parameter and the three ways out; a ``batch_size`` over a
rank's share warns and the start-up report shows the real batch; an HTTP error names its status."""

from __future__ import annotations

import functools
import io
import re
import socket
import threading
import warnings
from collections.abc import Iterator
from contextlib import redirect_stdout
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

import distkit
from distkit.errors import DistkitError
from distkit.storage import _transfer
from distkit.trainer import Trainer

CE = nn.functional.cross_entropy
SGD = functools.partial(torch.optim.SGD, lr=0.1)


class Blobs(Dataset):  # type: ignore[type-arg]
    def __init__(self, length: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.targets = torch.randint(0, 2, (length,), generator=generator)
        self.data = torch.randn(length, 8, generator=generator)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[index], self.targets[index]

    def __len__(self) -> int:
        return len(self.targets)


class DictBlobs(Blobs):
    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return {"inputs": self.data[index], "labels": self.targets[index]}


class Net(nn.Module):
    def __init__(self, hidden: int = 16, layers: int = 1) -> None:
        super().__init__()
        blocks: list[nn.Module] = []
        for i in range(layers):
            blocks += [nn.Linear(8 if i == 0 else hidden, hidden), nn.ReLU()]
        self.net = nn.Sequential(*blocks, nn.Linear(hidden, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


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


# --------------------------------------------------------------------------------------------------
# The first batch: where the exception was raised, then a guess


class DoubleInside(nn.Module):
    """A model whose forward feeds float64 into a float32 layer: a dtype error in the model."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).double())


def where_then_guess(message: str, where: str) -> None:
    assert where in message
    assert message.index(where) < message.index("Likely cause (a guess")


def test_a_dtype_error_inside_the_model_names_the_layer_not_loss_fn_or_the_target(tmp_path) -> None:
    with pytest.raises(DistkitError) as caught:
        quiet(str(tmp_path), max_steps=1).fit(DoubleInside(), Blobs(32), optimizer=SGD, loss_fn=CE)
    message = str(caught.value)
    assert message.startswith(
        "model(inputs) failed on the first batch (tensor (16, 8) float32, tensor (16,) int64)"
    )
    where_then_guess(message, "raised in the model's forward, in head (Linear), at ")
    assert "test_error_messages.py" in message  # the line of the model's code
    assert "loss_fn and the target were not reached" in message
    assert "drop loss_fn" not in message and "training_step" not in message  # advice that cannot help
    assert isinstance(caught.value.__cause__, RuntimeError)


class FixedProjection(nn.Module):
    """A layer that computes with a float32 buffer: FSDP's bf16 policy casts parameters, not buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("basis", torch.randn(4, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.basis)


class BufferNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), FixedProjection(), nn.ReLU(), nn.Linear(4, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def bf16_fsdp_float32_buffer(tmp: str) -> str:
    trainer = quiet(tmp, strategy="fsdp", precision="bf16-mixed", max_steps=1)
    try:
        trainer.fit(BufferNet(), Blobs(64), optimizer=SGD, loss_fn=CE)
    except DistkitError as err:
        return str(err)
    return "no error"


def test_bf16_fsdp_with_a_float32_buffer_is_reported_in_its_layer_with_a_dtype_guess(ranks, tmp_path) -> None:
    # (BatchNorm, the common case, trains: distkit keeps it in float32, tests/test_fsdp.py.)
    for message in ranks.run(bf16_fsdp_float32_buffer, str(tmp_path)):
        where_then_guess(message, "raised in the model's forward, in net.1 (FixedProjection)")
        guess = message.split("Likely cause", 1)[1]
        assert "bfloat16" in guess and "float32 buffer" in guess
        assert "drop loss_fn" not in message


def test_dict_batches_given_with_loss_fn_say_the_batch_is_the_problem(tmp_path) -> None:
    with pytest.raises(
        TypeError,
        match=r"the batch is the problem: .* got a dict with keys 'inputs', 'labels'\. "
        r"For dict batches leave out loss_fn",
    ):
        quiet(str(tmp_path), max_steps=1).fit(Net(), DictBlobs(32), optimizer=SGD, loss_fn=CE)


# --------------------------------------------------------------------------------------------------
# Resuming a changed model


def resume_message(root: str, strategy: str, model: nn.Module, resume: str) -> str:
    trainer = quiet(root, strategy=strategy, max_steps=4, enable_checkpointing=True, resume=resume)
    try:
        trainer.fit(model, Blobs(64), optimizer=SGD, loss_fn=CE)
    except DistkitError as err:
        return str(err)
    return "no error"


def changed_model_message(root: str, strategy: str) -> str:
    quiet(root, strategy=strategy, max_steps=2, enable_checkpointing=True).fit(
        Net(), Blobs(64), optimizer=SGD, loss_fn=CE
    )
    return resume_message(root, strategy, Net(hidden=32), "auto")


def check_three_ways_out(message: str, root: str) -> None:
    assert "1. to continue that run, build the model as it was when it was saved" in message
    second = "2. to train the changed model, start a new run in another directory: "
    assert f"{second}Trainer(default_root_dir='{root}-2')" in message
    third = "Trainer(resume=None, callbacks=[ModelCheckpoint(overwrite=True)])"
    assert f"3. or start over in {root}/checkpoints: {third}" in message
    assert "copying a param" not in message and "Size mismatch between" not in message  # not torch's text


def test_resuming_a_changed_model_names_the_directory_the_parameter_and_three_ways_out(tmp_path) -> None:
    root = str(tmp_path / "run")
    message = changed_model_message(root, "single")
    assert message.startswith(
        f"resume='auto' cannot load the checkpoints in {root}/checkpoints into the model"
    )
    assert "net.0.weight: (16, 8) in the checkpoint, (32, 8) in this model" in message
    assert "net.0.bias: (16,) in the checkpoint, (32,) in this model" in message
    assert "build the model as it was when it was saved (net.0.weight of shape (16, 8))" in message
    check_three_ways_out(message, root)


def test_resuming_from_a_path_into_a_model_with_another_layer_names_the_missing_parameters(tmp_path) -> None:
    root = str(tmp_path / "run")
    quiet(root, max_steps=2, enable_checkpointing=True).fit(Net(), Blobs(64), optimizer=SGD, loss_fn=CE)
    (step,) = (tmp_path / "run" / "checkpoints").glob("step_*")
    message = resume_message(str(tmp_path / "other"), "single", Net(layers=2), str(step))
    assert message.startswith(f"resume='{step}' cannot load {step} into the model given to fit()")
    assert "net.2.weight: (2, 16) in the checkpoint, (16, 16) in this model" in message
    assert "net.4.weight: in this model, not in the checkpoint" in message
    check_three_ways_out(message, str(tmp_path / "other"))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])  # a full checkpoint, a sharded one
def test_resuming_a_changed_model_on_two_ranks_says_the_same_on_every_rank(ranks, tmp_path, strategy) -> None:
    root = str(tmp_path / "run")
    messages = ranks.run(changed_model_message, root, strategy)
    assert messages[0] == messages[1]
    assert "net.0.weight: (16, 8) in the checkpoint, (32, 8) in this model" in messages[0]
    check_three_ways_out(messages[0], root)


# --------------------------------------------------------------------------------------------------
# batch_size over a rank's share


def report_and_warnings(tmp: str, length: int, batch_size: int) -> tuple[str, list[str], int]:
    out = io.StringIO()
    with warnings.catch_warnings(record=True) as caught, redirect_stdout(out):
        warnings.simplefilter("always")
        trainer = quiet(tmp, strategy="auto", max_steps=1, batch_size=batch_size)
        trainer.fit(Net(), Blobs(length), optimizer=SGD, loss_fn=CE)
    line = next((line for line in out.getvalue().splitlines() if "batch size" in line), "")
    # What callbacks (ProgressLog's samples/s) and scale_lr read: the batch a step really takes.
    effective = trainer.effective_batch_size
    return line, [str(w.message) for w in caught if "batch_size=" in str(w.message)], effective


def test_a_batch_size_over_the_dataset_warns_and_the_report_shows_the_real_batch(tmp_path) -> None:
    line, warned, effective = report_and_warnings(str(tmp_path), 40, 64)
    assert effective == 40
    assert warned == [
        "distributed_dataloader(): batch_size=64 is more than a rank's share of the dataset (the dataset "
        "has 40 samples), so every batch holds 40 samples, one batch per epoch. Pass batch_size <= 40, "
        "or use more data."
    ]
    assert (
        "batch size     40 per rank, 40 effective (40 x 1 ranks x 1 accumulated); batch_size=64 is more"
        in line
    )


def test_a_batch_size_over_a_ranks_share_warns_on_two_ranks_and_the_report_shows_the_real_batch(
    ranks, tmp_path
) -> None:
    (line, warned, effective), _ = ranks.run(report_and_warnings, str(tmp_path), 37, 5000)
    assert effective == 38
    assert warned == [
        "distributed_dataloader(): batch_size=5000 is more than a rank's share of the dataset (each of the "
        "2 ranks gets 19 of the 37 samples), so every batch holds 19 samples, one batch per epoch (38 over "
        "all ranks, not 10000). Pass batch_size <= 19, or use more data."
    ]
    assert "19 per rank, 38 effective (19 x 2 ranks x 1 accumulated)" in line
    assert "10000" not in line


# --------------------------------------------------------------------------------------------------
# HTTP errors


class StatusServer:
    """An HTTP server on 127.0.0.1 that answers ``/<status>`` with that status (``/500``: 500)."""

    def __init__(self) -> None:
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_HEAD(self) -> None:
                self.send_error(int(self.path.strip("/")))

            do_GET = do_HEAD

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()

    def url(self, status: int) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}/{status}"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


@pytest.fixture
def status_server(world_of_one: pytest.MonkeyPatch) -> Iterator[StatusServer]:
    world_of_one.setattr(_transfer, "_RETRY_BASE_S", 0.01)
    server = StatusServer()
    try:
        yield server
    finally:
        server.close()


def test_an_http_500_during_download_names_the_status_not_file_not_found(
    status_server, tmp_path: Path
) -> None:
    url = status_server.url(500)
    with pytest.raises(DistkitError) as caught:
        distkit.download(url, tmp_path / "d.bin")
    message = str(caught.value)
    assert message.startswith(
        f"[rank 0/1] looking up {url} failed after 4 attempts: the server answered HTTP 500 Internal "
        f"Server Error. A 5xx answer is a failure of the server"
    )
    assert "FileNotFoundError" not in message


def test_a_refused_connection_during_download_is_named_not_only_file_not_found(
    status_server, tmp_path: Path
) -> None:
    with socket.socket() as sock:  # a port with nothing listening
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/d.bin"
    with pytest.raises(DistkitError) as caught:
        distkit.download(url, tmp_path / "d.bin")
    # Was: "failed after 4 attempts: FileNotFoundError: http://..." alone (fsspec's word for it).
    expected = r"failed after 4 attempts: FileNotFoundError: .* \(from \S*ClientConnectorError"
    assert re.search(expected, str(caught.value)), caught.value


def test_http_client_errors_during_download_name_their_status(status_server, tmp_path: Path) -> None:
    with pytest.raises(
        PermissionError, match=r"the server answered HTTP 403 Forbidden: it refused the request's credentials"
    ):
        distkit.download(status_server.url(403), tmp_path / "d.bin")
    with pytest.raises(
        DistkitError, match=r"the server answered HTTP 400 Bad Request, a client error that is not retried"
    ):
        distkit.download(status_server.url(400), tmp_path / "d.bin")
    with pytest.raises(FileNotFoundError) as missing:  # a 404 stays a FileNotFoundError...
        distkit.download(status_server.url(404), tmp_path / "d.bin")
    assert any(
        "the server answered HTTP 404 Not Found" in note for note in missing.value.__notes__
    )  # ...named
