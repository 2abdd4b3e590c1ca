"""PyTorch's own DataLoader tests (``test/test_dataloader.py`` of the torch the tests pin)
run with ``DataLoader`` replaced by ``pinfeed.DataLoader`` (``test_torch_dataloader.py``)."""
