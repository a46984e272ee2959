"""Small torch modules that tests export with torch.export: real weights, a known shape."""

from __future__ import annotations

import torch


class Linear(torch.nn.Module):
    """One linear layer, `inputs` features in, `outputs` out."""

    def __init__(self, inputs: int = 3, outputs: int = 2) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(inputs, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


class SequenceMean(Linear):
    """The linear layer on each step of a sequence [batch, length, inputs], averaged over it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x).mean(1)
