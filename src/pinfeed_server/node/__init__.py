"""The node: what every loader of this server shares. ``budget.py`` admits loaders and
live changes against the node's limits; ``tuning.py`` runs each loader's autotune."""
