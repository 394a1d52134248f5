"""The page components the simulator and the live dashboard both draw with.

`components.js` (slots, the KV pool: a tile per block, or a canvas map of a large pool, the
queue, a step's rows) and `components.css` are inlined into each page, which therefore stays
one self-contained file: no CDN, no fetch.
"""

from __future__ import annotations

from importlib import resources

__all__ = ["inline_components"]

_JS_MARK = "/*__VIEW_JS__*/"
_CSS_MARK = "/*__VIEW_CSS__*/"


def inline_components(template: str) -> str:
    """`template` with the shared components' CSS and JavaScript put in place of its
    `/*__VIEW_CSS__*/` (inside a <style>) and `/*__VIEW_JS__*/` (inside a <script>) marks."""
    if _JS_MARK not in template or _CSS_MARK not in template:
        raise ValueError("the page template lacks the components' marks")
    files = resources.files("kvserve.view")
    css = files.joinpath("components.css").read_text(encoding="utf-8")
    js = files.joinpath("components.js").read_text(encoding="utf-8")
    return template.replace(_CSS_MARK, css).replace(_JS_MARK, js)
