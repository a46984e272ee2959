"""The lifting pass that lets torchao quantize an exported program: every linear on constant
weights becomes an `nn.Linear` again, with the same outputs and no weight kept twice."""

from __future__ import annotations

import torch
from torch import nn

from server.quantize.torch_graph import LIFTED_PREFIX, lift_linear_layers


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(4 * 8 * 8, 16), nn.ReLU(), nn.Linear(16, 3, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv(x)))


class RuntimeWeight(nn.Module):
    """A linear whose weight is an input: there is no module to give back."""

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, weight)


def test_linears_are_lifted_with_the_same_outputs_and_no_duplicate_weights() -> None:
    torch.manual_seed(0)
    example = torch.randn(2, 1, 8, 8)
    module = torch.export.export(Mixed().eval(), (example,)).module()
    expected = module(example)
    assert lift_linear_layers(module) == 2
    assert torch.equal(module(example), expected)
    layers = {name: m for name, m in module.named_modules() if isinstance(m, nn.Linear)}
    assert sorted(layers) == [f"{LIFTED_PREFIX}0", f"{LIFTED_PREFIX}1"]
    assert layers[f"{LIFTED_PREFIX}1"].bias is None
    names = [name for name, _ in module.named_parameters()]
    assert not any(name.startswith("head.") for name in names), names  # the originals are gone
    assert {"conv.weight", "conv.bias"} <= set(names)  # what was not lifted stays


def test_a_weight_computed_at_run_time_is_left_alone() -> None:
    x, weight = torch.randn(2, 4), torch.randn(3, 4)
    module = torch.export.export(RuntimeWeight(), (x, weight)).module()
    assert lift_linear_layers(module) == 0
    assert torch.allclose(module(x, weight), x @ weight.T)
