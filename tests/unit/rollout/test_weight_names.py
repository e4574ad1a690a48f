"""The weight-name rule's dry run (lorarl/rollout/vllm/weight_names.py) on a stand-in model whose
loader behaves like vLLM 0.23's: fused parameters found through named_parameters(), a KeyError for a
name it does not know, a silent skip of another, and one parameter written directly."""

from __future__ import annotations

import pytest
import torch

from lorarl.rollout.vllm.weight_names import (
    UNCHECKED,
    _dry_run,
    checkpoint_named_parameters,
    weight_targets,
)


class Wrapped(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.base_layer = torch.nn.Linear(4, 6, bias=False)


class Model(torch.nn.Module):
    """q/k -> qkv (stacked, looked up, KeyError when missing), o (skipped when missing), norm (copied)."""

    def __init__(self, wrapped: bool) -> None:
        super().__init__()
        self.qkv = Wrapped() if wrapped else torch.nn.Linear(4, 6, bias=False)
        self.o = torch.nn.Linear(4, 4, bias=False)
        self.norm = torch.nn.Parameter(torch.ones(4))

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, tensor in weights:
            if name in ("q.weight", "k.weight"):
                param = params["qkv.weight"]  # KeyError under a wrapper, as vLLM 0.23's stacked branch
                param.weight_loader(param, tensor, name[0])
            elif name == "norm":
                params["norm"].data.copy_(tensor)  # no weight_loader: a meta tensor cannot be copied
            elif name in params:
                params[name].weight_loader(params[name], tensor)
            elif name == "rotary.inv_freq":
                continue  # skipped without a word
            else:
                raise ValueError(f"no parameter {name}")


SHAPES = {"q.weight": ("float32", [3, 4]), "k.weight": ("float32", [3, 4]), "o.weight": ("float32", [4, 4]),
          "norm": ("float32", [4]), "rotary.inv_freq": ("float32", [2]), "bogus.weight": ("float32", [1])}


def test_names_land_where_the_loader_writes_them_and_nothing_is_copied() -> None:
    model = Model(wrapped=False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    targets = _dry_run(model, SHAPES, unwrap=False)
    assert targets == {"q.weight": ["qkv.weight"], "k.weight": ["qkv.weight"], "o.weight": ["o.weight"],
                       "norm": [f"{UNCHECKED}NotImplementedError"], "rotary.inv_freq": [], "bogus.weight": []}
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert all(not hasattr(p, "weight_loader") for p in model.parameters())  # the recorders are gone


def test_a_loader_blind_to_the_wrapper_gets_the_unwrapped_names(monkeypatch: pytest.MonkeyPatch) -> None:
    from lorarl.rollout.vllm import weight_names

    model = Model(wrapped=True)
    as_is = _dry_run(model, SHAPES, unwrap=False)
    assert as_is["q.weight"] == [] and as_is["o.weight"] == ["o.weight"]
    with checkpoint_named_parameters(model):
        assert sorted(n for n, _ in model.named_parameters()) == ["norm", "o.weight", "qkv.weight"]
    assert "qkv.base_layer.weight" in dict(model.named_parameters())  # restored on the way out
    monkeypatch.setattr(weight_names, "lora_wrapped", lambda m: True)  # the stand-in wrapper is no vLLM layer
    targets = weight_targets(model, SHAPES)
    assert targets["q.weight"] == ["qkv.base_layer.weight"] and weight_names.needs_unwrapped_names(model)
