"""Seed 002's single-file DDP example with distkit.Trainer: python examples/train_single_file.py"""

import torch
from torch import nn
from torch.utils.data import TensorDataset

import distkit

if __name__ == "__main__":  # fit() starts 2 processes that import this file: keep work below
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 10))
    dataset = TensorDataset(torch.randn(10000, 20), torch.randint(0, 10, (10000,)))
    trainer = distkit.Trainer(strategy="ddp", devices=2, max_epochs=10, batch_size=32)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.001)
    trainer.fit(model, dataset, optimizer=optimizer, loss_fn=nn.CrossEntropyLoss())
