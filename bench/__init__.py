"""Benchmarks of pinfeed against ``torch.utils.data.DataLoader``.

``python -m bench`` (or ``pinfeed bench``) runs the suite and writes ``docs/bench.json``
and ``docs/bench.png``; ``python -m bench --help`` lists the knobs. ``python -m
bench.gpu`` measures host-to-device copies and GPU idle share on a CUDA machine.
"""
