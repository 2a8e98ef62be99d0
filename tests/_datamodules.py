"""Lightning's own data classes for tests/test_data_by_reference.py, in a module of their own so
that importing pytorch_lightning is paid by the tests that use them (``tests/`` is on the path:
pickling names these classes by reference, as it would a user's package)."""

from __future__ import annotations

import pytorch_lightning as pl
import torch
from pytorch_lightning.core.mixins import HyperparametersMixin
from torch.utils.data import DataLoader, Dataset, TensorDataset

FEATURES = 256


class LitSums(pl.LightningDataModule):
    """``n`` seeded rows of ``FEATURES`` numbers (4 MiB for ``n=4096``), made in ``setup``."""

    def __init__(self, n: int = 4096, batch_size: int = 512) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(self.hparams.n, FEATURES, generator=g)
        self.train = TensorDataset(x, x.sum(1, keepdim=True))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=self.hparams.batch_size, shuffle=True)


class LitRows(Dataset, HyperparametersMixin):
    """A dataset that records its arguments with Lightning's ``save_hyperparameters()``."""

    def __init__(self, n: int, seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.x = torch.randn(n, FEATURES, generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.x[i].sum(0, keepdim=True)
