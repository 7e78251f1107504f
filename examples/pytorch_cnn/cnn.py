"""The model and the data of one client: a small CNN on 8x8 digits.

Each client holds one IID share of scikit-learn's bundled handwritten digits (no
download), seen as 1x8x8 images, and keeps a fifth of it aside to evaluate the global
model when the server asks.
"""

from __future__ import annotations

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions, one 2x2 pooling, one linear layer: 5.4k parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 8, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(8, 16, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 16 x 4 x 4
        )
        self.classifier = nn.Linear(16 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).flatten(1))


def client_loaders(
    index: int, num_clients: int, seed: int, batch_size: int = 32
) -> tuple[DataLoader, DataLoader]:
    """Train and validation loaders of client ``index`` of ``num_clients``.

    Every client shuffles the data set with the same ``seed``, so the shares are disjoint
    without anyone handing them out.
    """
    if not 0 <= index < num_clients:
        raise ValueError(f"client index {index} is not in 0..{num_clients - 1}")
    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[:, None]  # N x 1 x 8 x 8, in [0, 1]
    labels = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(labels))
    share = np.array_split(order, num_clients)[index]
    cut = len(share) * 4 // 5
    train, val = share[:cut], share[cut:]

    def dataset(rows: np.ndarray) -> TensorDataset:
        return TensorDataset(torch.from_numpy(images[rows]), torch.from_numpy(labels[rows]))

    shuffle = torch.Generator().manual_seed(seed + index)  # reproducible batches
    return (
        DataLoader(dataset(train), batch_size=batch_size, shuffle=True, generator=shuffle),
        DataLoader(dataset(val), batch_size=256),
    )
