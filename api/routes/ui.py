"""The live page's routes: its static files (``/ui``, ``/ui/app.js``, ``/ui/app.css``) and
the data it polls (``/ui/state``); what they answer is :mod:`api.ui`'s."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from api import ui
from api.common import ENC, JSON, off_loop
from api.jsonroutes import service_of

router = APIRouter()


def _page(body: bytes, ctype: str) -> Callable[[], Awaitable[Response]]:
    async def serve() -> Response:
        # no-cache: a new version of the service serves its own page at once.
        return Response(body, media_type=ctype, headers={"Cache-Control": "no-cache"})

    return serve


for _path, (_name, _ctype) in ui.ASSETS.items():
    router.add_api_route(_path, _page((ui.STATIC / _name).read_bytes(), _ctype), methods=["GET"],
                         include_in_schema=_path == "/ui", tags=["ui"],
                         summary="The live page of the fleet (HTML; no token needed for the page itself, its "
                         "data needs it when reads do)" if _path == "/ui" else "", response_class=Response)


@router.get("/ui/state", tags=["ui"], summary="What the live page shows: workers, models, over-time samples and "
            "recent routing decisions (counters only: no tree is walked)")
async def ui_state(request: Request,
                   decisions_model: Annotated[str | None, Query(max_length=256)] = None) -> Response:
    return Response(ENC.encode(ui.state(service_of(request), decisions_model)), media_type=JSON)


@router.get("/ui/replay", tags=["ui"], summary="The fleet and the routing decisions as the service's recording "
            "(record_dir) has them at unix time t: the recording replayed up to there (404 without record_dir)",
            responses={404: {"description": "this service does not record (record_dir is not set)"}})
async def ui_replay(request: Request, t: Annotated[float, Query(description="unix seconds")]) -> Response:
    svc = service_of(request)
    if svc.recording.directory is None:
        return Response(ENC.encode({"detail": "this service does not record (record_dir is not set)"}),
                        status_code=404, media_type=JSON)
    return Response(ENC.encode(await off_loop(svc.recording.at, t)), media_type=JSON)
