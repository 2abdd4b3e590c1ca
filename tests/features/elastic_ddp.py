"""A torchrun job (gloo, CPU) on pinfeed loaders, one per rank, for test_elastic_ddp.

    torchrun --nproc-per-node=N tests/features/elastic_ddp.py PREFIX SOCKET OUT PHASE K

Rank r reads loader ``PREFIX-r``. PHASE ``first``: train K batches of epoch 0, then
``state_dict()`` (gathered over the process group: every rank calls it) and rank 0
saves it to ``OUT/ckpt.pt``, and ``torch.distributed.checkpoint`` saves the loader to
``OUT/dcp``; train 2 batches more (lost with the job) and stop; each rank saves the
samples it had at the checkpoint to ``OUT/first-rank{r}.pt``. PHASE ``resume``: every
rank loads ``OUT/ckpt.pt`` (rank 0's file), or, PHASE ``resume-dcp``, the loader from
``OUT/dcp``, trains the rest of epoch 0 and all of epoch 1, and saves them to
``OUT/resume-rank{r}.pt``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo, for `tests`

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from pinfeed import Loader


def main() -> None:
    prefix, socket, out, phase, k = (
        sys.argv[1],
        sys.argv[2],
        Path(sys.argv[3]),
        sys.argv[4],
        int(sys.argv[5]),
    )
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    with Loader(f"{prefix}-{rank}", socket=socket) as loader:
        if phase == "first":
            seen: list[int] = []
            for step, batch in enumerate(loader):
                seen += batch[3].tolist()
                if step == k - 1:
                    state = loader.state_dict()  # a collective: every rank is here
                    if rank == 0:
                        torch.save(state, out / "ckpt.pt")
                    dcp.save({"loader": loader}, checkpoint_id=str(out / "dcp"))
                    torch.save(seen, out / f"first-rank{rank}.pt")
                if step == k + 1:
                    break
            dist.barrier()
        else:
            if phase == "resume-dcp":  # the loader's state_dict() is the template
                dcp.load({"loader": loader}, checkpoint_id=str(out / "dcp"))
            else:
                loader.load_state_dict(torch.load(out / "ckpt.pt", weights_only=True))
            epochs = []
            for epoch in range(2):
                loader.set_epoch(epoch)  # after the load: epoch 0 keeps its position
                epochs.append([[t.clone() for t in b] for b in loader])
            torch.save(epochs, out / f"resume-rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
