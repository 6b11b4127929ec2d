"""Tensors a trainer puts that the engine does not hold are never sent; whether that is said is the user's choice,
``SyncOptions(extra_tensors=...)``: a warning naming them (the default), a ``PlanError`` before a byte moves, or
nothing. A tied model's second name for its embedding is never extra."""

from __future__ import annotations

import warnings

import pytest
import torch

import rlsync
from rlsync.adapters.hf import ModuleReceiver
from rlsync.layouts import from_state_dict


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(32, 8)
        self.head = torch.nn.Linear(8, 32, bias=False)
        self.head.weight = self.embed.weight  # state_dict() has both names; named_parameters() the first only


def sync(trainer_state: dict[str, torch.Tensor], engine: torch.nn.Module, extra_tensors: str) -> ModuleReceiver:
    options = rlsync.SyncOptions(extra_tensors=extra_tensors)
    with ModuleReceiver(engine, options=options) as receiver:
        with rlsync.WeightsWriter(from_state_dict(trainer_state), None, 0, [receiver.address], options=options) as writer:
            writer.multi_put(trainer_state)
            writer.complete(1)
    return receiver


def test_an_extra_tensor_is_named_in_a_warning_and_the_rest_still_lands() -> None:
    trainer, engine = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    state = {**trainer.state_dict(), "weight_ema": torch.zeros(4, 4), "step": torch.zeros(1)}
    with pytest.warns(rlsync.RlsyncWarning, match=r"2 tensor\(s\) put that the engine does not hold, not sent: 'step', "
                                                   r"'weight_ema'; .*extra_tensors='ignore'"):
        receiver = sync(state, engine, "warn")
    assert receiver.version == 1 and torch.equal(engine.weight, trainer.weight)


def test_with_error_nothing_moves() -> None:
    trainer, engine = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    before = engine.weight.detach().clone()
    with pytest.raises(rlsync.PlanError, match="'weight_ema'"):
        sync({**trainer.state_dict(), "weight_ema": torch.zeros(4, 4)}, engine, "error")
    assert torch.equal(engine.weight, before)


def test_ignore_says_nothing_and_a_tied_alias_is_never_extra() -> None:
    trainer, engine = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sync({**trainer.state_dict(), "weight_ema": torch.zeros(4, 4)}, engine, "ignore")
        tied_trainer, tied_engine = Tied(), Tied()
        assert set(tied_trainer.state_dict()) == {"embed.weight", "head.weight"}
        receiver = sync(tied_trainer.state_dict(), tied_engine, "error")
    assert receiver.version == 1 and torch.equal(tied_engine.head.weight, tied_trainer.embed.weight)


def test_an_unknown_choice_is_refused_when_the_options_are_built() -> None:
    with pytest.raises(rlsync.ConfigError, match="extra_tensors='warning': use one of warn, error, ignore"):
        rlsync.SyncOptions(extra_tensors="warning")
