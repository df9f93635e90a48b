"""Issue 23, point 6: ``Trainer.predict`` and ``validate`` on Hugging Face style dict batches, with
and without ``labels``, in one process and on 2-rank gloo groups (DDP, and FSDP after a fit).

``transformers`` is not installed in this project's environment, so the model is a small causal
language model written the Hugging Face way: ``forward(input_ids, attention_mask=None,
labels=None)`` returns a ``ModelOutput``-like dict (``loss`` only when ``labels`` are given, fields
that are ``None`` left out, readable as attributes), with the loss of shifted next-token labels."""

from __future__ import annotations

import functools
from collections import OrderedDict
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from distkit.errors import DistkitError
from distkit.trainer import Trainer

VOCAB, LENGTH, WIDTH = 32, 8, 16


class CausalLMOutput(OrderedDict):  # type: ignore[type-arg]
    """As ``transformers.modeling_outputs.CausalLMOutput``: a dict whose ``None`` fields are left
    out, also read as attributes (``output.loss``)."""

    def __init__(self, **fields: Any) -> None:
        super().__init__((key, value) for key, value in fields.items() if value is not None)

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class TinyCausalLM(nn.Module):
    """A GPT-style model in miniature with a Hugging Face signature."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Embedding(LENGTH, WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> CausalLMOutput:
        hidden = self.wte(input_ids) + self.wpe(torch.arange(input_ids.shape[1]))
        if attention_mask is not None:
            hidden = hidden * attention_mask[..., None]
        logits = self.lm_head(torch.tanh(self.mix(hidden)))
        loss = None
        if labels is not None:  # next-token prediction, as GPT2LMHeadModel
            loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
        return CausalLMOutput(loss=loss, logits=logits)


class Tokens(Dataset):  # type: ignore[type-arg]
    """Random token blocks as a tokenizer's dicts; ``labels`` (= ``input_ids``) optional."""

    def __init__(self, length: int, *, labels: bool, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.input_ids = torch.randint(0, VOCAB, (length, LENGTH), generator=generator)
        self.labels = labels

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        item = {"input_ids": self.input_ids[index], "attention_mask": torch.ones(LENGTH, dtype=torch.long)}
        if self.labels:
            item["labels"] = self.input_ids[index]
        return item

    def __len__(self) -> int:
        return len(self.input_ids)


def quiet(tmp: str, **kwargs: Any) -> Trainer:
    options: dict[str, Any] = {
        "default_root_dir": tmp,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "batch_size": 4,
        "val_batch_size": 4,
        "max_epochs": 1,
    }
    options.update(kwargs)
    return Trainer(**options)


def exact(model: nn.Module, data: Tokens) -> tuple[torch.Tensor, float]:
    """The logits of every sample in dataset order and the loss over the whole set, in one call."""
    with torch.no_grad():
        out = model(data.input_ids, torch.ones_like(data.input_ids), labels=data.input_ids)
    return out.logits, out.loss.item()


def check_in_order(predicted: Any, want: torch.Tensor) -> None:
    # The loss a model computes from labels is one number per batch: no prediction, left out.
    assert isinstance(predicted, dict) and list(predicted) == ["logits"]
    assert torch.allclose(predicted["logits"], want, atol=1e-5)


def test_predict_and_validate_take_dict_batches_with_and_without_labels_in_one_process(tmp_path) -> None:
    torch.manual_seed(0)
    model = TinyCausalLM()
    trainer = quiet(str(tmp_path))
    want_logits, want_loss = exact(model, Tokens(22, labels=True))
    # 22 samples in batches of 4: the per-batch loss (6 values) must not be taken for predictions.
    check_in_order(trainer.predict(model, Tokens(22, labels=True)), want_logits)
    check_in_order(trainer.predict(model, Tokens(22, labels=False)), want_logits)
    assert trainer.validate(model, Tokens(22, labels=True)) == {
        "val_loss": pytest.approx(want_loss, rel=1e-5)
    }
    # Without labels the model computes no loss: the error says the batches lack them.
    with pytest.raises(
        DistkitError, match=r"the batch has no target: its keys are 'input_ids', 'attention_mask'"
    ):
        trainer.validate(model, Tokens(22, labels=False))


def dict_batches_on_ranks(tmp: str, strategy: str) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    torch.manual_seed(0)
    model = TinyCausalLM()
    trainer = quiet(tmp, strategy=strategy)
    if strategy == "fsdp":  # sharded by the fit: the forward passes run in lockstep afterwards
        trainer.fit(
            model, Tokens(16, labels=True, seed=1), optimizer=functools.partial(torch.optim.SGD, lr=0.1)
        )
    data = Tokens(21, labels=True)  # 11 + 10 samples: an uneven split, 3 batches on each rank
    result = {
        "with_labels": trainer.predict(model, data, all_ranks=True),
        "without_labels": trainer.predict(model, Tokens(21, labels=False), all_ranks=True),
        "val": trainer.validate(model, data),
    }
    plain = TinyCausalLM()
    if strategy == "fsdp":
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        plain.load_state_dict(full)
    else:
        plain.load_state_dict(model.state_dict())
    result["want_logits"], result["want_loss"] = exact(plain, data)
    return result


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_predict_and_validate_take_dict_batches_on_two_ranks_in_dataset_order(
    ranks, tmp_path, strategy
) -> None:
    for result in ranks.run(dict_batches_on_ranks, str(tmp_path), strategy):
        check_in_order(result["with_labels"], result["want_logits"])
        check_in_order(result["without_labels"], result["want_logits"])
        assert result["val"] == {"val_loss": pytest.approx(result["want_loss"], rel=1e-5)}


class BatchStatistic(nn.Module):
    """A predict_step that returns one value per batch beside a per-sample one."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(LENGTH, 2)

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        scores = self.linear(batch["input_ids"].float())
        return {"scores": scores, "mean_per_batch": scores.mean(0)}


def test_an_output_without_one_row_per_sample_is_named_instead_of_an_index_error(tmp_path) -> None:
    with pytest.raises(
        ValueError,
        match=r"predict_step\(\) returned a tensor of shape \(2,\) at output\['mean_per_batch'\] for batch 0 "
        r"\(4 samples\)\. Return one row per sample",
    ):
        quiet(str(tmp_path)).predict(BatchStatistic(), Tokens(10, labels=False))


def rows_problem_on_ranks(tmp: str) -> str:
    try:
        quiet(tmp, strategy="ddp").predict(BatchStatistic(), Tokens(10, labels=False))
    except ValueError as err:
        return str(err)
    return "no error"


def test_an_output_without_one_row_per_sample_fails_predict_on_every_rank(ranks, tmp_path) -> None:
    first, second = ranks.run(rows_problem_on_ranks, str(tmp_path))
    assert first == second and first.startswith("[rank 0/2] predict() puts every sample's prediction back")
