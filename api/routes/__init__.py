"""The service's routes, one module per role: queries, admin (engines, snapshot), ops
(probes, metrics, workers, stats), Dynamo's routes, the OpenAI gateway and the live page. Each declares an
``APIRouter`` at import; ``create_app`` includes them in this order, and the service
binds their JSON routes (``JSON_ROUTES``)."""

from __future__ import annotations

from fastapi import APIRouter

from api.jsonroutes import JsonSpec
from api.routes import admin, dynamo, gateway, ops, query, ui

ROUTERS: tuple[APIRouter, ...] = (query.router, admin.router, ops.router, dynamo.router, gateway.router, ui.router)
JSON_ROUTES: tuple[JsonSpec, ...] = (*query.router.specs, *admin.router.specs, *dynamo.router.specs)
