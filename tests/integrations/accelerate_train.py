"""An Accelerate training loop on a pinfeed loader, for tests/integrations.

    python tests/integrations/accelerate_train.py LOADER SOCKET CKPT OUT ROUTE [--resume]

ROUTE: how Accelerate learns of the loader: ``register`` (``prepare`` hands a Loader
back as it is, so ``accelerator.register_for_checkpointing(loader)``) or ``prepare``
(``accelerator.prepare_data_loader(loader)``, which tracks it like a stateful
DataLoader; test_accelerate runs that route in one process). Without ``--resume`` it
trains 3 batches, ``save_state``s, and trains 2 more (consumed after the checkpoint);
with ``--resume`` a new process ``load_state``s and trains the rest of the epoch. OUT
gets the batches trained on.
"""

from __future__ import annotations

import sys

import torch
from accelerate import Accelerator

from pinfeed import Loader


def main() -> None:
    name, socket, ckpt, out, route = sys.argv[1:6]
    resume = "--resume" in sys.argv
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = Loader(name, socket=socket)
    model, opt, same = accelerator.prepare(model, opt, loader)
    assert same is loader
    if route == "register":
        accelerator.register_for_checkpointing(loader)
    else:
        assert accelerator.prepare_data_loader(loader) is loader
    if resume:
        accelerator.load_state(ckpt)
    seen = []
    for step, (x, y) in enumerate(loader):
        seen.append([x.clone(), y.clone()])
        loss = (model(x).squeeze(1) - y.float()).pow(2).mean()
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        if not resume and step == 2:
            accelerator.save_state(ckpt)
        if not resume and step == 4:
            break
    torch.save(seen, out)
    loader.close()


if __name__ == "__main__":
    main()
