"""A deep MLP whose saved activations dwarf its parameters: the simplest model to offload."""
from __future__ import annotations

import torch
import torch.nn as nn


def build(batch: int = 512, width: int = 256, depth: int = 4, seed: int = 0):
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(width, 1))
    return model, (torch.randn(batch, width),)
