"""An Accelerate job on CPU processes (torchrun, gloo) over pinfeed loaders, one per
rank, for test_accelerate's elastic test.

    torchrun --nproc-per-node=N tests/integrations/accelerate_elastic.py PREFIX SOCKET OUT PHASE K

The loader is ``register_for_checkpointing``-ed. PHASE ``first``: train K batches of
epoch 0, ``save_state(OUT/ckpt)`` (on every rank, as Accelerate wants: the loaders'
``state_dict()`` gathers every rank's position, and the main process writes it), train
2 more (lost) and stop; each rank saves its samples to ``OUT/first-rank{r}.pt``. PHASE
``resume``: ``load_state(OUT/ckpt)`` on N ranks, then the rest of epoch 0 and epoch 1,
saved to ``OUT/resume-rank{r}.pt``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo, for `tests`

import torch
from accelerate import Accelerator

from pinfeed import Loader


def main() -> None:
    prefix, socket, out, phase, k = sys.argv[1:6]
    out_dir, steps = Path(out), int(k)
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = Loader(f"{prefix}-{rank}", socket=socket)
    model, opt = accelerator.prepare(model, opt)
    accelerator.register_for_checkpointing(loader)
    if phase == "first":
        seen: list[int] = []
        for step, batch in enumerate(loader):
            seen += batch[3].tolist()
            if step == steps - 1:
                accelerator.save_state(out_dir / "ckpt")
                torch.save(seen, out_dir / f"first-rank{rank}.pt")
            if step == steps + 1:
                break
    else:
        accelerator.load_state(out_dir / "ckpt")
        epochs = []
        for epoch in range(2):
            loader.set_epoch(epoch)
            epochs.append([[t.clone() for t in b] for b in loader])
        torch.save(epochs, out_dir / f"resume-rank{rank}.pt")
    accelerator.wait_for_everyone()
    loader.close()
    accelerator.end_training()


if __name__ == "__main__":
    main()
