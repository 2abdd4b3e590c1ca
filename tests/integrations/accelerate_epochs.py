"""An Accelerate training loop of 3 epochs over a Hugging Face streaming dataset with a
shuffle buffer, for tests/integrations: the loop calls no ``set_epoch`` itself (what
Accelerate's prepared loader does each epoch is what moves the stream on).

    python tests/integrations/accelerate_epochs.py torch|pinfeed SOCKET OUT

OUT gets the batches trained on, epoch by epoch.
"""

from __future__ import annotations

import sys

import datasets
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

import pinfeed


def main() -> None:
    which, socket, out = sys.argv[1:4]
    accelerator = Accelerator(cpu=True)
    table = datasets.Dataset.from_dict({"x": list(range(48)), "y": [i % 5 for i in range(48)]})
    stream = table.to_iterable_dataset(num_shards=4).shuffle(seed=42, buffer_size=4)
    stream = stream.with_format("torch")
    if which == "torch":
        loader = DataLoader(stream, batch_size=4, num_workers=2)
    else:
        loader = pinfeed.DataLoader(stream, batch_size=4, num_workers=2, socket=socket)
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    seen: list[list[torch.Tensor]] = []
    for _ in range(3):
        epoch = []
        for batch in loader:
            epoch.append(batch["x"].clone())
            loss = (model(batch["x"].float()[:, None]).squeeze(1) - batch["y"]).pow(2).mean()
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
        seen.append(epoch)
    torch.save(seen, out)


if __name__ == "__main__":
    main()
