"""Lightning DDP on two CPU processes, each rank on its own pinfeed loader shard.

    python tests/integrations/lightning_ddp.py LOADER_PREFIX SOCKET OUT_DIR

Rank r trains on loader ``LOADER_PREFIX-r`` for 2 epochs and saves the batches it saw
to ``OUT_DIR/rank{r}.pt``. Lightning starts rank 1 by running this command again.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo, for `tests`

import torch

from tests.integrations.lightning_module import Recorder, trainer


def main() -> None:
    prefix, socket, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    model = Recorder({"train": prefix, "socket": socket})
    fit = trainer(max_epochs=2, devices=2, strategy="ddp")
    fit.fit(model)
    torch.save(model.train_seen, out / f"rank{fit.global_rank}.pt")


if __name__ == "__main__":
    main()
