"""The documentation pages work without the internet: every script, style and icon they load
comes from this server, which often runs air-gapped."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest

from server.dataplane import DataPlane
from server.http.app import create_app
from server.repository import ModelRepository

PAGES = ["/docs", "/redoc", "/docs/oauth2-redirect"]
DOCUMENT_PAGES = ["/docs", "/redoc"]  # the pages that render the OpenAPI document
CONTENT_TYPES = {
    ".js": {"text/javascript", "application/javascript"},
    ".css": {"text/css"},
    ".png": {"image/png"},
}


class _AssetLinks(HTMLParser):
    """The URLs a browser fetches for a page: <script src>, <link href>, <img src>."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        wanted = {"script": "src", "link": "href", "img": "src"}.get(tag)
        self.urls += [value for name, value in attrs if name == wanted and value]


def asset_urls(page: str) -> list[str]:
    links = _AssetLinks()
    links.feed(page)
    return links.urls


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(DataPlane(ModelRepository(tmp_path)))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://batchline.test") as c:
        yield c


@pytest.mark.parametrize("path", PAGES)
async def test_a_page_names_no_other_host(client: httpx.AsyncClient, path: str) -> None:
    response = await client.get(path)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    external = re.findall(r"https?://[^\s'\"<>]*", response.text)
    assert not external, f"{path} names other hosts, which an air-gapped browser cannot reach: {external}"
    for url in asset_urls(response.text):
        assert url.startswith("/") and not url.startswith("//"), f"{path} loads {url} from elsewhere"


@pytest.mark.parametrize("path", DOCUMENT_PAGES)
async def test_a_page_loads_its_assets_from_this_server(client: httpx.AsyncClient, path: str) -> None:
    page = (await client.get(path)).text
    urls = asset_urls(page)
    assert any(u.endswith(".js") for u in urls), f"{path} loads no script: {urls}"
    for url in urls:
        asset = await client.get(url)
        assert asset.status_code == 200, url
        content_type = asset.headers["content-type"].split(";")[0]
        assert content_type in CONTENT_TYPES[Path(url).suffix], (url, content_type)
        assert len(asset.content) > 1000, f"{url} is only {len(asset.content)} bytes"
        if url.endswith(".png"):
            assert asset.content.startswith(b"\x89PNG"), url


@pytest.mark.parametrize(("path", "renderer"), [("/docs", "SwaggerUIBundle"), ("/redoc", "Redoc")])
async def test_the_script_served_is_the_renderer_the_page_needs(
    client: httpx.AsyncClient, path: str, renderer: str
) -> None:
    scripts = [u for u in asset_urls((await client.get(path)).text) if u.endswith(".js")]
    assert len(scripts) == 1, scripts
    assert renderer in (await client.get(scripts[0])).text


@pytest.mark.parametrize("path", DOCUMENT_PAGES)
async def test_a_page_shows_this_servers_document(client: httpx.AsyncClient, path: str) -> None:
    page = (await client.get(path)).text
    assert re.search(r"""(url: |spec-url=)['"]/openapi\.json['"]""", page), page
    assert (await client.get("/openapi.json")).json()["info"]["title"] == "Batchline"
