"""torch's ``DataLoader`` replaced by ``pinfeed.DataLoader`` in every Python process of a
run of PyTorch's own ``test/test_dataloader.py`` (``tests/torch_suite``), where
``PINFEED_TORCH_SUITE=pinfeed``.

This folder is put first on ``PYTHONPATH`` of that run, so Python imports this module at
start-up (``site``): in the pytest process, before the test module's
``from torch.utils.data import DataLoader``; in the processes the tests spawn
(``ErrorTrackingProcess`` children re-import the test module); and in the scripts they
run with ``python -c`` (``from torch.utils.data import DataLoader`` there too). The
names replaced are the ones torch exposes the class by: ``torch.utils.data.DataLoader``
and ``torch.utils.data.dataloader.DataLoader``. ``pinfeed.DataLoader`` keeps the
original as its base class: it took it at its own import, before the swap.

The pinfeed server the run's trainers start (``PINFEED_AUTOSTART``: it inherits this
environment) is left as it is anywhere else: it makes batches and uses no DataLoader. So are
multiprocessing's helper processes (its resource tracker and forkserver), which would only
import torch for nothing.
"""

import os
import sys

_HELPERS = ("from multiprocessing.resource_tracker", "from multiprocessing.forkserver")


def _left_alone() -> bool:
    argv = list(sys.orig_argv)
    if argv[1:3] == ["-m", "pinfeed_server"]:
        return True
    return "-c" in argv[:-1] and argv[argv.index("-c") + 1].startswith(_HELPERS)


def _swap() -> None:
    import torch.utils.data
    import torch.utils.data.dataloader

    import pinfeed

    original = torch.utils.data.dataloader.DataLoader
    assert pinfeed.DataLoader.__mro__[1] is original, "pinfeed.DataLoader's base is not torch's"
    torch.utils.data.DataLoader = pinfeed.DataLoader
    torch.utils.data.dataloader.DataLoader = pinfeed.DataLoader


if os.environ.get("PINFEED_TORCH_SUITE") == "pinfeed" and not _left_alone():
    _swap()
