"""The forkserver is forked from the server, so it and its workers share the server's
pages of torch and the dataset kinds instead of importing them again."""

from __future__ import annotations

import psutil

from pinfeed import Client, Loader
from tests.conftest import Server
from tests.helpers import smaps_rollup, unique


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
            # Forked, not exec'd: the same command line, and its children are the workers.
            assert len(forkservers) == 1, [c.cmdline() for c in me.children()]
            workers = forkservers[0].children()
            assert len(workers) >= 2
            for proc in [forkservers[0], *workers]:
                m = smaps_rollup(proc.pid)
                # torch alone is ~140 MiB of anonymous memory; an exec'd process would
                # hold it privately (Pss_Anon close to Anonymous), a forked one shares it.
                assert m["Anonymous"] > 64 << 20
                assert m["Pss_Anon"] < 0.6 * m["Anonymous"], (proc.pid, m)
    finally:
        admin.delete_loader(name)
        admin.delete_dataset(name)
