"""One error tree for both sides: ``pinfeed.errors``. The server defines no exception
class with a slug of its own; what its problem+json handler answers and what its data
plane sends map back to the very class it raised, with the same hierarchy; a batch too
large for its slot is a ``SampleError``. The server's own exception classes are domain
errors, each answered as the problem it declares, or signals caught in their package."""

from __future__ import annotations

import ast
import asyncio
import importlib
import inspect
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel

import pinfeed
import pinfeed.errors
import pinfeed_server
from pinfeed import protocol as p
from pinfeed.errors import (
    DATA_PLANE_ERRORS,
    ERRORS,
    PROBLEM_PREFIX,
    BatchTooLarge,
    DataPlaneError,
    InternalError,
    InvalidRequest,
    LoaderBusy,
    MethodNotAllowed,
    NotFound,
    PinfeedError,
    ProblemError,
    SampleError,
    UnsupportedMediaType,
    error_from_info,
    error_from_slug,
)
from pinfeed_server.api.problems import PROBLEM_JSON
from pinfeed_server.engine.producers.base import error_info
from pinfeed_server.errors import DomainError
from pinfeed_server.main import create_app
from pinfeed_server.settings import Settings

PROBLEMS = [c for c in ERRORS if issubclass(c, ProblemError)]
# The server's exceptions that are caught inside their own package (tests below check
# that no module outside it names them); every other one must leave as a problem.
SIGNALS = {"CacheBusy", "CorruptRecord", "LockTimeout", "OutputError"}


def _slugs(cls: type[PinfeedError]) -> list[str]:
    """The class's hierarchy as slugs, in method resolution order."""
    return [c.slug for c in cls.__mro__ if issubclass(c, PinfeedError)]


def _server_modules() -> Iterator[ModuleType]:
    """Every module of pinfeed_server. From its files, not pkgutil.walk_packages, which
    skips namespace packages (engine/ has no __init__.py)."""
    root = Path(pinfeed_server.__file__).parent
    for path in sorted(root.rglob("*.py")):
        name = ".".join(("pinfeed_server", *path.relative_to(root).with_suffix("").parts))
        if name.endswith(".__main__"):  # importing it runs the CLI
            continue
        yield importlib.import_module(name.removesuffix(".__init__"))


def _server_exceptions() -> list[type[BaseException]]:
    """Every exception class the server's modules define, private ones (``_X``) aside."""
    found = {
        cls
        for module in _server_modules()
        for name, cls in inspect.getmembers(module, inspect.isclass)
        if cls.__module__ == module.__name__
        and issubclass(cls, BaseException)
        and not name.startswith("_")
    }
    return sorted(found, key=lambda c: f"{c.__module__}.{c.__name__}")


SERVER_ERRORS = [c for c in _server_exceptions() if c.__name__ not in SIGNALS]


# -- the one tree ------------------------------------------------------------------------
def test_the_server_defines_no_error_class_of_its_own() -> None:
    """A server class with a slug would be a type the client cannot map back: raise (or
    add to) pinfeed.errors' classes instead."""
    own = [
        f"{module.__name__}.{name}"
        for module in _server_modules()
        for name, cls in inspect.getmembers(module, inspect.isclass)
        if cls.__module__ == module.__name__
        and issubclass(cls, BaseException)
        and hasattr(cls, "slug")
    ]
    assert own == []


def test_the_tree_is_every_class_once_each_after_its_bases() -> None:
    defined = [
        cls
        for _, cls in inspect.getmembers(pinfeed.errors, inspect.isclass)
        if cls.__module__ == "pinfeed.errors" and issubclass(cls, BaseException)
    ]
    assert sorted(ERRORS, key=str) == sorted(defined, key=str)
    assert len(set(ERRORS)) == len(ERRORS) == len({c.slug for c in ERRORS}), "one slug each"
    for i, cls in enumerate(ERRORS):
        assert all(ERRORS.index(base) < i for base in cls.__bases__ if base in ERRORS), cls
        assert getattr(pinfeed, cls.__name__) is cls, f"{cls.__name__} is not exported"


def test_every_data_plane_class_declares_whether_it_ends_the_connection() -> None:
    for cls in ERRORS:
        if issubclass(cls, DataPlaneError) and cls is not DataPlaneError:
            assert isinstance(cls.fatal, bool), cls
    assert set(DATA_PLANE_ERRORS.values()) == {c for c in ERRORS if c.fatal is not None}


def test_the_tree_imports_only_the_wire_format() -> None:
    """Worker processes and the HTTP layer import it alike: no torch, no FastAPI."""
    tree = ast.parse(Path(pinfeed.errors.__file__).read_text())
    imported = {
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in tree.body
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    # sys: a sample error joins the dataset's own exception class, found in sys.modules;
    # contextlib, importlib and re: such a joined class found by its pickled name
    stdlib = {"__future__", "contextlib", "importlib", "re", "sys", "typing"}
    assert imported == stdlib | {"pinfeed.protocol"}


# -- HTTP: the server's handler, then the client's mapping -------------------------------
class Body(BaseModel):
    name: str


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> FastAPI:
    """The real app without its lifespan (no service): pure routing through the handlers,
    with routes that raise what the handlers must map."""
    tmp = tmp_path_factory.mktemp("tree")
    app = create_app(Settings(state_dir=tmp, data_root=tmp, socket=tmp / "s"))

    @app.get("/raise/{index}")
    async def raise_problem(index: int) -> None:
        raise PROBLEMS[index]("what went wrong", hint="what to do")

    @app.post("/body")
    async def take_body(body: Body) -> None:
        return None

    @app.get("/server-error/{index}")
    async def raise_server_error(index: int) -> None:
        raise SERVER_ERRORS[index]("what went wrong")

    @app.get("/bug")
    async def bug() -> None:
        raise RuntimeError("a bug")

    @app.get("/teapot")
    async def teapot() -> None:
        raise HTTPException(418, "a status no class names")

    return app


def _get(app: FastAPI, path: str, **kwargs: Any) -> httpx.Response:
    async def call() -> httpx.Response:
        transport = httpx.ASGITransport(app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://pinfeed") as c:
            return await c.request(kwargs.pop("method", "GET"), path, **kwargs)

    return asyncio.run(call())


def _rebuilt(response: httpx.Response) -> PinfeedError:
    """The exception a client rebuilds from a problem+json response."""
    assert response.headers["content-type"] == PROBLEM_JSON
    body = response.json()
    assert body["type"].startswith(PROBLEM_PREFIX)
    return error_from_slug(body.pop("type"), body.pop("detail"), **body)


@pytest.mark.parametrize("index", range(len(PROBLEMS)), ids=[c.__name__ for c in PROBLEMS])
def test_a_problem_the_server_raises_is_the_same_class_for_the_client(
    app: FastAPI, index: int
) -> None:
    cls = PROBLEMS[index]
    response = _get(app, f"/raise/{index}")
    assert response.status_code == cls.status
    error = _rebuilt(response)
    assert type(error) is cls
    assert _slugs(type(error)) == _slugs(cls)
    assert error.detail == "what went wrong" and error.extra["hint"] == "what to do"
    assert error.extra["title"] == cls.title and error.extra["status"] == cls.status


@pytest.mark.parametrize(
    ("request_kwargs", "status", "cls"),
    [
        ({"url": "/v2/nothing"}, 404, NotFound),
        ({"url": "/healthz", "method": "POST"}, 405, MethodNotAllowed),
        ({"url": "/raise/x"}, 422, InvalidRequest),
        ({"url": "/body", "method": "POST", "content": b"{bad"}, 422, InvalidRequest),
        ({"url": "/body", "method": "POST", "content": b"x=1", "headers": {
            "content-type": "application/x-www-form-urlencoded"}}, 415, UnsupportedMediaType),
        ({"url": "/bug"}, 500, InternalError),
        ({"url": "/teapot"}, 418, ProblemError),
    ],
)  # fmt: skip
def test_what_the_framework_raises_maps_to_the_class_of_its_status(
    app: FastAPI, request_kwargs: dict[str, Any], status: int, cls: type[ProblemError]
) -> None:
    response = _get(app, request_kwargs.pop("url"), **request_kwargs)
    assert response.status_code == status
    error = _rebuilt(response)
    assert type(error) is cls
    assert error.extra["title"] == cls.title and error.extra["status"] == status


# -- the server's own errors -------------------------------------------------------------
def test_every_server_exception_is_a_domain_error_or_a_signal_of_its_package() -> None:
    """A server exception that is neither would leave a route as a 500 (or be sent as a
    protocol error on the data plane): a domain error declares the problem it is."""
    names = {c.__name__ for c in SERVER_ERRORS}
    refusals = {"ConfigError", "DatasetError", "DuplicateName", "LayoutError", "NotCacheable"}
    assert refusals | {"PluginError", "SamplerError"} <= names  # found: not checked in vain
    assert [c.__name__ for c in SERVER_ERRORS if not issubclass(c, DomainError)] == []
    root = Path(pinfeed_server.__file__).parent
    for cls in _server_exceptions():
        if cls.__name__ not in SIGNALS:
            continue
        home = root.joinpath(*cls.__module__.split(".")[1:2])  # its package: cache/, engine/
        named = [
            path.relative_to(root)
            for path in root.rglob("*.py")
            if not path.is_relative_to(home) and cls.__name__ in path.read_text()
        ]
        assert named == [], f"{cls.__name__} leaves {home.name}/: make it a DomainError"


@pytest.mark.parametrize(
    "index", range(len(SERVER_ERRORS)), ids=[c.__name__ for c in SERVER_ERRORS]
)
def test_a_server_error_raised_in_a_route_is_the_problem_it_declares(
    app: FastAPI, index: int
) -> None:
    cls = SERVER_ERRORS[index]
    problem = getattr(cls, "problem", InternalError)
    response = _get(app, f"/server-error/{index}")
    assert response.status_code == problem.status != 500
    error = _rebuilt(response)
    assert type(error) is problem
    assert error.detail == "what went wrong"


# -- the data plane: an ERROR, then the client's mapping ---------------------------------
@pytest.mark.parametrize("slug", DATA_PLANE_ERRORS)
def test_a_data_plane_error_round_trips_with_its_fatal_flag(slug: str) -> None:
    cls = DATA_PLANE_ERRORS[slug]
    sent = cls("what went wrong", index=3, error_type="KeyError").info().at(1, 2)
    assert (sent.slug, sent.fatal) == (slug, cls.fatal)
    info = p.ErrorInfo.decode(sent.encode())
    assert info == sent
    error = error_from_info(info)
    assert type(error) is cls
    assert _slugs(type(error)) == _slugs(cls)
    assert error.detail == "what went wrong"
    assert error.extra == {"index": 3, "error_type": "KeyError", "epoch": 1, "batch_index": 2}
    assert error.info() == sent, "the client's exception is the server's ERROR again"


def test_a_batch_too_large_is_a_sample_error() -> None:
    """One batch's failure: on_error applies and the loader goes on, so one except clause."""
    sent = BatchTooLarge("raise max_batch_bytes", index=None, error_type="BatchTooLarge")
    with pytest.raises(SampleError) as caught:
        raise error_from_info(p.ErrorInfo.decode(sent.info().at(0, 4).encode()))
    assert type(caught.value) is BatchTooLarge
    assert (caught.value.epoch, caught.value.batch_index) == (0, 4)
    assert not caught.value.fatal, "the connection goes on"


def test_what_a_dataset_raises_reaches_the_trainer_as_a_sample_error() -> None:
    """A SampleError (BatchTooLarge too) as it is; anything else, even a pinfeed error the
    dataset's own code raised (a fatal one would end the trainer's connection), is a
    sample-error naming the type and where it happened."""
    too_large = BatchTooLarge("raise max_batch_bytes", index=None, error_type="BatchTooLarge")
    for raised in (KeyError("k"), LoaderBusy("a dataset that attaches a Loader of its own")):
        try:
            raise raised
        except Exception as exc:
            info = error_info(exc)
        assert (info.slug, info.fatal) == ("sample-error", False)
        assert info.extra["error_type"] == type(raised).__name__
        assert "test_error_tree.py" in info.extra["where"]
    assert error_info(too_large) == too_large.info()


def test_a_joined_sample_error_class_pickles_into_a_fresh_process() -> None:
    """The class itself (not only an instance) crosses processes, as the dataset's own
    exception class does: multiprocessing's ExceptionWrapper, which torch's tests use
    to send a child's exception to its parent, pickles the exception's type."""
    import pickle
    import subprocess
    import sys

    from torch.utils.data._utils import ExceptionWrapper

    info = p.ErrorInfo(
        "sample-error", "boom", False, extra={"error_module": "builtins", "error_type": "KeyError"}
    )
    try:
        raise pinfeed.errors.error_from_info(info)
    except Exception:
        wrapped = pickle.dumps(ExceptionWrapper(sys.exc_info()))
    code = (
        "import pickle, sys\n"
        "w = pickle.loads(sys.stdin.buffer.read())\n"
        "print(w.exc_type.__name__, issubclass(w.exc_type, KeyError), w.exc_type.__module__)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], input=wrapped, capture_output=True, check=True
    )
    assert out.stdout.split() == [b"SampleError[KeyError]", b"True", b"pinfeed.errors"]
