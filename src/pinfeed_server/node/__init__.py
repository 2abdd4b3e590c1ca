"""The node: what every loader of this server shares. ``budget.py`` admits loaders and
live changes against the node's limits; ``arbiter.py`` divides the workers among the
loaders by their trainers' stall and priority (and, off, runs each loader's autotune)."""
