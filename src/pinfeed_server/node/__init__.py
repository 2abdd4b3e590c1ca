"""The node: what every loader of this server shares. Entry points: ``NodeBudget``
(``budget.py``) admits loaders, live changes and caches against the node's limits;
``NodeArbiter`` (``arbiter.py``) divides the workers among the loaders by their
trainers' stall and priority (and, off, runs each loader's autotune), through the
service's one live-change path."""
