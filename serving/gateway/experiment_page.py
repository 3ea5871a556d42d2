"""The experiment's live page: GET /experiment on the OpenAI gateway (`--experiment-page`).

One self-contained HTML page (serving/gateway/experiment_page.html: its CSS and JavaScript inline,
nothing fetched from elsewhere, so it works offline and behind a firewall) that reads the same JSON
as any other client, GET /v1/experiment and /v1/experiment/ecdf, every few seconds, and shows each
arm's share of traffic, requests, users and percentiles, each metric's estimate with its
always-valid interval and how far its test has gone towards a decision, the rollout's step, moves
and guardrails, and the arms' TTFT and ITL ECDFs drawn as SVG.

The page itself holds no data, so it is served without the API key (a browser cannot send one when
it opens a page); its requests for the data carry the key, asked for on the page when the gateway
answers 401, and count as reads against the gateway's bound (serving/gateway/guard.py) like any
other. A Content-Security-Policy keeps it from loading or sending anything beyond this server.
"""
from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import HTMLResponse

PAGE_PATH = "/experiment"
POLL_S = 2.0
PAGE = Path(__file__).with_name("experiment_page.html")
# inline script and style only; fetches to this origin only; no frames, forms elsewhere or images
POLICY = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
          "form-action 'none'; frame-ancestors 'none'; base-uri 'none'")


def page_html(poll_s: float = POLL_S) -> str:
    if not poll_s > 0:
        raise ValueError(f"the page's poll interval must be positive, not {poll_s}")
    return PAGE.read_text().replace("__POLL_MS__", str(round(poll_s * 1000)))


def add_experiment_page(app: FastAPI, poll_s: float = POLL_S) -> None:
    """Serve the page on `app` (an A/B gateway's: it reads /v1/experiment)."""
    html = page_html(poll_s)

    @app.get(PAGE_PATH, include_in_schema=False)
    async def experiment_page() -> HTMLResponse:
        return HTMLResponse(html, headers={"Content-Security-Policy": POLICY, "Cache-Control": "no-store",
                                           "X-Content-Type-Options": "nosniff"})
