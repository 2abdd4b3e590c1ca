"""The documentation's sources (``mkdocs.yml`` builds ``docs/`` into the site) and the
tools that keep its generated parts true: ``docs.blocks`` (blocks of a page that a
program writes) and ``docs.gen`` (the reference, from the code). Not installed: like
``bench`` and ``tests``, a part of the checkout."""
