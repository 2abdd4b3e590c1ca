"""``Client``: the HTTP admin API for scripts and orchestration tools (httpx).

    with Client() as c:
        c.create_dataset("demo", "synthetic", {...})
        c.create_loader("demo", dataset="demo", batch_size=10, shuffle=True, seed=0)
        print(c.loader_stats("demo")["consumer_wait_share"])

Problem+json errors come back as the typed exceptions of ``pinfeed.errors``; a server
that cannot be reached raises ``ServerUnavailable`` (naming the URL), as the data plane does.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from pinfeed.errors import PinfeedError, ProblemError, ServerUnavailable, error_from_slug
from pinfeed.protocol import HTTP_CLIENT_HEADER

if TYPE_CHECKING:
    import httpx

DEFAULT_URL = "http://127.0.0.1:8321"


def _item(collection: str, name: str, *rest: str) -> str:
    """``/v1/<collection>/<name>``: the name is quoted so '/' or '..' cannot change the route."""
    return "/".join((f"/v1/{collection}", quote(name, safe=""), *rest))


class Client:
    def __init__(
        self,
        url: str | None = None,
        *,
        token: str | None = None,
        timeout: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        url = url or os.environ.get("PINFEED_URL", DEFAULT_URL)
        token = token if token is not None else os.environ.get("PINFEED_TOKEN")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        # The server paces each client apart (its address and this header): one
        # process's Client is one client, whatever else runs on the node's loopback.
        headers[HTTP_CLIENT_HEADER] = f"pinfeed-{os.getpid()}"
        import httpx  # here, not at import: a trainer or server without a Client pays no 0.2 s

        self._http = httpx.Client(
            base_url=url, headers=headers, timeout=timeout, transport=transport
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        import httpx

        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            # The same error as a data-plane connection that cannot be made or broke.
            raise ServerUnavailable(
                f"cannot reach the pinfeed server at {self._http.base_url}: "
                f"{type(exc).__name__}: {exc}; is `pinfeed serve` running (PINFEED_URL)?"
            ) from None
        if response.status_code >= 400:
            raise self._problem(response)
        return response

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self._send(method, path, **kwargs)
        if response.status_code == 204 or not response.content:
            return None
        return response.json()

    @staticmethod
    def _problem(response: httpx.Response) -> PinfeedError:
        try:
            body = response.json()
        except ValueError:
            body = {}
        if not isinstance(body, dict):
            body = {}
        slug = str(body.pop("type", ""))
        detail = str(body.pop("detail", response.text or response.reason_phrase))
        error = error_from_slug(slug, detail, **body)
        if not isinstance(error, ProblemError):
            error = ProblemError(detail, **body)
        error.status = response.status_code
        return error

    # health and metrics
    def health(self) -> dict[str, Any]:
        result: dict[str, Any] = self._request("GET", "/healthz")
        return result

    def ready(self) -> dict[str, Any]:
        """``{"status": "ok"}``; raises ``NotReady`` while a loader is still starting."""
        result: dict[str, Any] = self._request("GET", "/readyz")
        return result

    def metrics(self) -> str:
        """The Prometheus text exposition of ``GET /metrics``."""
        return self._send("GET", "/metrics").text

    # datasets
    def create_dataset(
        self, name: str, kind: str, params: dict[str, Any], *, cache: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Register a dataset; ``cache={"max_bytes": ..., "persist": ...}`` keeps its
        samples once per node (see ``POST /v1/datasets``)."""
        body: dict[str, Any] = {"name": name, "kind": kind, "params": params}
        if cache is not None:
            body["cache"] = cache
        result: dict[str, Any] = self._request("POST", "/v1/datasets", json=body)
        return result

    def datasets(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self._request("GET", "/v1/datasets")
        return result

    def dataset(self, name: str) -> dict[str, Any]:
        result: dict[str, Any] = self._request("GET", _item("datasets", name))
        return result

    def delete_dataset(self, name: str) -> None:
        self._request("DELETE", _item("datasets", name))

    def drop_cache(self, name: str) -> dict[str, Any]:
        """Empty dataset ``name``'s cache (refused while a loader reads it)."""
        result: dict[str, Any] = self._request("DELETE", _item("datasets", name, "cache"))
        return result

    # loaders
    def create_loader(self, name: str, *, dataset: str, **config: Any) -> dict[str, Any]:
        result: dict[str, Any] = self._request(
            "POST", "/v1/loaders", json={"name": name, "dataset": dataset, **config}
        )
        return result

    def loaders(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self._request("GET", "/v1/loaders")
        return result

    def loader(self, name: str) -> dict[str, Any]:
        result: dict[str, Any] = self._request("GET", _item("loaders", name))
        return result

    def loader_stats(self, name: str) -> dict[str, Any]:
        result: dict[str, Any] = self._request("GET", _item("loaders", name, "stats"))
        return result

    def batch(self, name: str, epoch: int, index: int) -> dict[str, Any]:
        """Batch ``index`` of ``epoch`` of loader ``name``: its sample ``indices`` and the
        ``rank`` and ``worker`` that make it (``Loader.replay`` makes it again)."""
        path = _item("loaders", name, "batches", str(epoch), str(index))
        result: dict[str, Any] = self._request("GET", path)
        return result

    def patch_loader(self, name: str, **changes: Any) -> dict[str, Any]:
        """Change ``num_workers``/``prefetch_factor`` (or ``priority``, ``min_workers``,
        ``autotune``) live."""
        result: dict[str, Any] = self._request("PATCH", f"/v1/loaders/{name}", json=changes)
        return result

    def node(self) -> dict[str, Any]:
        """The node: CPUs, budgets, every loader's workers and trainers' wait share, the
        arbiter's last decisions (``GET /v1/node``)."""
        result: dict[str, Any] = self._request("GET", "/v1/node")
        return result

    def delete_loader(self, name: str) -> None:
        self._request("DELETE", _item("loaders", name))
