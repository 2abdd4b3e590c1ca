"""The loader engine: one ``LoaderEngine`` per loader (``loader.py``), composed of the
parts it owns, and the data plane that serves it to trainers.

    loader.py           the engine: plan -> producer -> in-order publisher -> consumers
    producer_handle.py  its current producer (producers/), resized or swapped live
    resizer.py          its ring moved to what a live change wants
    publisher.py        results in any order, published in plan order
    consumers.py        the trainers attached, a group's shared or split batches
    dataplane.py        the Unix socket: attach; session.py: one trainer's messages
    prepare.py          a config checked against its dataset: plugins, plan, layout
    config.py           a loader's configuration, declared once; LiveChange
    sampler.py, custom_sampler.py, iterable.py   batch plans (DataLoader's samplers)
    collate.py, batchlayout.py                   batches written into ring slots
    ring.py             memfd segments and the slot table
    autotune.py         one loader's tuning rules; stats.py, status.py: what it reports
"""
