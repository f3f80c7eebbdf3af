"""Finds everything a built HTML site would load from another host: the docs must work offline.

A page may *link* to other sites (an ``<a href>`` is followed only when the reader clicks it), but nothing may
be *loaded* from one when a page is viewed: no script, stylesheet, font, image, frame or CSS import from a
CDN or Google Fonts. :func:`external_loads` lists each such reference as ``(file, reference)``; the Sphinx
extension (``vitkit_docs``) fails the build when the list is not empty, and ``python docs/_ext/offline_check.py
DIR`` checks a built folder by hand.
"""

from __future__ import annotations

import re
import sys
from html.parser import HTMLParser
from pathlib import Path

# an absolute or protocol-relative URL: anything that leaves the site
EXTERNAL = re.compile(r"^\s*(?:[a-zA-Z][a-zA-Z0-9+.-]*:)?//", re.ASCII)
# attributes that make a browser fetch what they name, by element
LOADING_ATTRS: dict[str, tuple[str, ...]] = {
    "script": ("src",),
    "img": ("src", "srcset"),
    "iframe": ("src",),
    "frame": ("src",),
    "embed": ("src",),
    "object": ("data",),
    "source": ("src", "srcset"),
    "video": ("src", "poster"),
    "audio": ("src",),
    "track": ("src",),
    "input": ("src",),
    "image": ("href", "xlink:href"),  # SVG
    "use": ("href", "xlink:href"),  # SVG
}
# <link rel=...> values whose href is not fetched
LINK_NOT_FETCHED = {"canonical", "author", "license", "alternate", "help", "search", "next", "prev", "index", "top"}
CSS_URL = re.compile(r"""url\(\s*['"]?([^'")\s]+)""")
CSS_IMPORT = re.compile(r"""@import\s+['"]([^'"]+)""")  # @import url(...) is found by CSS_URL
# a script that fetches or injects from an absolute URL (string literals only: comments and licences mention URLs)
JS_STRING_URL = re.compile(r"""(['"`])((?:https?:)?//[^'"`\s]+)\1""")
# URLs that name something rather than load it (XML namespaces, doctypes)
NOT_LOADED = re.compile(r"^(https?:)?//(www\.w3\.org|www\.w3c\.org|purl\.org|schemas\.)", re.ASCII)


def _srcset_urls(value: str) -> list[str]:
    return [part.strip().split()[0] for part in value.split(",") if part.strip()]


def css_loads(text: str) -> list[str]:
    """Absolute URLs that a stylesheet (a file, a ``<style>`` element or a ``style`` attribute) loads."""
    found = CSS_URL.findall(text) + CSS_IMPORT.findall(text)
    return [u for u in found if EXTERNAL.match(u) and not NOT_LOADED.match(u)]


def _strip_js_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.DOTALL)
    return re.sub(r"(?m)(^|[^:\\'\"])//[^\n]*", r"\1", text)


def js_loads(text: str) -> list[str]:
    """Absolute URLs in a script's string literals (what it could fetch or inject), comments left out."""
    urls = [m.group(2) for m in JS_STRING_URL.finditer(_strip_js_comments(text))]
    return [u for u in urls if not NOT_LOADED.match(u)]


class _PageParser(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.loads: list[str] = []
        self._in: str | None = None  # "script" or "style" while inside one

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = {k.lower(): v or "" for k, v in attrs}
        for attr in LOADING_ATTRS.get(tag, ()):
            if attr in values:
                urls = _srcset_urls(values[attr]) if attr == "srcset" else [values[attr]]
                self.loads += [u for u in urls if EXTERNAL.match(u) and not NOT_LOADED.match(u)]
        if tag == "link" and "href" in values:
            rels = set(values.get("rel", "").lower().split())
            if (not rels or not rels <= LINK_NOT_FETCHED) and EXTERNAL.match(values["href"]):
                self.loads.append(values["href"])
        if "style" in values:
            self.loads += css_loads(values["style"])
        if tag in ("script", "style"):
            self._in = tag

    def handle_endtag(self, tag: str) -> None:
        if tag == self._in:
            self._in = None

    def handle_data(self, data: str) -> None:
        if self._in == "style":
            self.loads += css_loads(data)
        elif self._in == "script":
            self.loads += js_loads(data)


def html_loads(text: str) -> list[str]:
    """Absolute URLs that an HTML page loads when viewed (scripts, stylesheets, images, frames, CSS imports)."""
    parser = _PageParser()
    parser.feed(text)
    parser.close()
    return parser.loads


def external_loads(site: str | Path) -> list[tuple[str, str]]:
    """Every (file, URL) in a built site that would be fetched from another host when a page is viewed."""
    root = Path(site)
    out: list[tuple[str, str]] = []
    for path in sorted(root.rglob("*")):
        if not path.is_file():
            continue
        suffix = path.suffix.lower()
        if suffix not in (".html", ".htm", ".css", ".js", ".svg"):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if suffix in (".html", ".htm", ".svg"):
            urls = html_loads(text)
        elif suffix == ".css":
            urls = css_loads(text)
        else:
            urls = js_loads(text)
        out += [(str(path.relative_to(root)), u) for u in urls]
    return out


if __name__ == "__main__":
    site = sys.argv[1] if len(sys.argv) > 1 else "docs/_build/html"
    found = external_loads(site)
    for file, url in found:
        print(f"{file}: loads {url}", file=sys.stderr)
    print(f"{len(found)} external loads in {site}")
    sys.exit(1 if found else 0)
