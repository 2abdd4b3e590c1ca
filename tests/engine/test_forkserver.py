"""The forkserver is forked from the server, so it, the datasets' zygotes forked from
it and their workers share the server's pages of torch and the dataset kinds instead
of importing them again."""

from __future__ import annotations

import psutil
import pytest

from pinfeed import Client, Loader
from tests.conftest import Server
from tests.helpers import smaps_rollup, unique


@pytest.mark.serial  # the server tree's PSS against its anonymous memory
def test_forkserver_and_workers_share_the_servers_pages(admin: Client, server: Server) -> None:
    name = unique("fork")
    admin.create_dataset(
        name, "synthetic", {"length": 16, "fields": [{"shape": [3, 8, 8], "dtype": "float32"}]}
    )
    admin.create_loader(name, dataset=name, batch_size=4, num_workers=2)
    try:
        with Loader(name, socket=server.socket) as loader:
            next(iter(loader))
            assert server.proc is not None
            me = psutil.Process(server.proc.pid)
            forkservers = [c for c in me.children() if c.cmdline() == me.cmdline() and c.children()]
            # Forked, not exec'd: the same command line; its children are the datasets'
            # zygotes, and theirs the workers.
            assert len(forkservers) == 1, [c.cmdline() for c in me.children()]
            zygotes = [z for z in forkservers[0].children() if len(z.children()) >= 2]
            assert len(zygotes) >= 1
            workers = zygotes[0].children()
            for proc in [forkservers[0], zygotes[0], *workers]:
                m = smaps_rollup(proc.pid)
                # torch alone is ~140 MiB of anonymous memory; an exec'd process would
                # hold it privately (Pss_Anon close to Anonymous), a forked one shares it.
                assert m["Anonymous"] > 64 << 20
                assert m["Pss_Anon"] < 0.6 * m["Anonymous"], (proc.pid, m)
    finally:
        admin.delete_loader(name)
        admin.delete_dataset(name)
