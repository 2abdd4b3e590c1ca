"""pinfeed's service (``pinfeed serve``): ``src/pinfeed_server``.

Entry points: ``main`` below (the ``pinfeed`` command: ``cli.py``), ``main.create_app``
(the FastAPI app, whose lifespan starts and stops a ``service.Service``), and
``service.Service`` itself (the rules over the engine, the registry and the node).
docs/architecture/index.md maps the packages and what each may never do.

Its dependencies are the ``server`` extra (``pip install 'pinfeed[server]'``); a trainer
image that installs ``pinfeed`` alone gets the client library and no server packages.
"""

from pinfeed import __version__  # one version for the one distribution

__all__ = ["__version__", "main"]


def main() -> None:
    """The ``pinfeed`` command; says what to install when the server extra is missing."""
    try:
        from pinfeed_server.cli import main as cli_main
    except ModuleNotFoundError as exc:
        raise SystemExit(
            f"the pinfeed command is the server, and it needs {exc.name!r}: "
            "pip install 'pinfeed[server]' (the trainer library alone needs none of it)"
        ) from None
    cli_main()
