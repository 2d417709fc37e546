"""The viewer page: one self-contained HTML file (inline CSS and JS from :mod:`.assets`, the
episodes as inline JSON; opens without a network).

Every field of a run folder reaches the page as data only: the episodes are JSON inside a
``<script type="application/json">`` (``<``, ``>``, ``&`` escaped), and the page's script escapes
every value it inserts. On top, the page carries a Content-Security-Policy (:func:`page_csp`) that
lets only the page's own script run (by its hash): no inline event handler, no other script, no
network.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import html
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from .assets import CSS, JS

_OVERLAYS = (("none", "no overlay"), ("mask", "loss mask"), ("advantage", "advantage"),
             ("ratio", "ratio ρ = π_old/µ"), ("masked", "masked / clipped tokens"))


def _json_for_script(data: Any) -> str:
    """JSON safe inside ``<script>``: ``<``, ``>``, ``&`` and U+2028/9 escaped."""
    s = json.dumps(data, ensure_ascii=False, default=str)
    for a, b in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"),
                 ("\u2029", "\\u2029")):
        s = s.replace(a, b)
    return s


def page_csp() -> str:
    """The page's Content-Security-Policy: nothing loads, only the page's script (by its SHA-256)
    runs, inline styles are allowed."""
    digest = base64.b64encode(hashlib.sha256(JS.encode("utf-8")).digest()).decode()
    return (f"default-src 'none'; script-src 'sha256-{digest}'; style-src 'unsafe-inline'; "
            "img-src data:; base-uri 'none'; form-action 'none'")


def render_page(episodes: list[dict[str, Any]], title: str) -> str:
    """The HTML text of the viewer for ``episodes`` (:func:`~.load.load_episodes` dicts)."""
    opts = "".join(f'<option value="{k}">{html.escape(v)}</option>' for k, v in _OVERLAYS)
    legend = ('<span class="legend">model <span style="background:#ddf4ff">text</span> · '
              '<span class="call">tool call</span> · <span style="background:#fff8c5">tool output</span> · '
              'masked: <span style="background:rgba(207,34,46,.55)">DIS-masked</span> '
              '<span style="background:rgba(251,143,68,.6)">clipped (advantage)</span></span>')
    filters = ('<label>benchmark<select id="f-benchmark"><option value="">all</option></select></label>'
               '<label>step<select id="f-step"><option value="">all</option></select></label>'
               '<label>finish<select id="f-finish"><option value="">all</option></select></label>'
               '<label>reward ≥<input id="f-rmin" type="number" step="any"></label>'
               '<label>≤<input id="f-rmax" type="number" step="any"></label>'
               f'<label>overlay<select id="f-overlay">{opts}</select></label>')
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta http-equiv=\"Content-Security-Policy\" content=\"{page_csp()}\">"
            f"<title>{html.escape(title)}</title><style>{CSS}</style></head>"
            f"<body data-overlay=\"none\"><header><h1>{html.escape(title)}</h1>{filters}{legend}"
            "<span id=\"count\"></span></header><main id=\"episodes\"></main>"
            "<script id=\"data\" type=\"application/json\">"
            f"{_json_for_script({'episodes': episodes})}</script>"
            f"<script>{JS}</script></body></html>\n")


def write_page(episodes: list[dict[str, Any]], title: str, out: str | Path) -> Path:
    """Write :func:`render_page` to ``out`` (parent created); returns the path.

    The page is written to a new file beside ``out`` and renamed over it, so a symlink at ``out``
    (e.g. a crafted run folder's ``view.html`` pointing at a file of the user's) is replaced
    itself, never followed: its target is not written.

    Raises:
        OSError: the page cannot be written there.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(render_page(episodes, title))
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return out


__all__ = ["page_csp", "render_page", "write_page"]
