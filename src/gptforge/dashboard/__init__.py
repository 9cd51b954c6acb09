"""The live web dashboard: a read-only view of run folders in the browser (`gptforge dashboard [FOLDER...]`).

Python's standard library only, never torch or numpy: it starts at once and only reads files. `server` serves
the page and a small JSON API; `runs` finds run folders and reads their files; `static/` holds the page (one
HTML, one JS, one CSS file), whose charts are drawn by plotly.js from the installed `plotly` package.
"""

from gptforge.dashboard.server import start_dashboard

__all__ = ["start_dashboard"]
