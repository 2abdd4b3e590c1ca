"""Benchmarks of pinfeed against ``torch.utils.data.DataLoader`` and a tuned DataLoader.

``python -m bench`` runs every section (``python -m bench --list``), each writing a
result file under ``docs/results/`` (``bench.results``), then ``python -m bench report``
makes every table in README.md and ``docs/**/*.md`` from those files (``bench.report``).
"""
