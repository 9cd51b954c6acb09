"""The live web dashboard (`gptforge dashboard [FOLDER...]`): a read-only view of run folders in the browser,
standard library only (never torch or numpy), so it starts at once. `server` (page and JSON API), `runs` (run
folders and their state), `records` (their files), `options` (`gptforge dashboard`'s), `static/`;
docs/ARCHITECTURE.md "The dashboard".
Imports: core."""

from gptforge.dashboard.server import start_dashboard

__all__ = ["start_dashboard"]
