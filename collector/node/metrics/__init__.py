"""The collector's optional Prometheus endpoint: `/metrics` (see `catalog`) and `/healthz`."""

from .catalog import HAMI, LEGACY, OWN, Metric
from .families import Health, KubeHealth, PodNames, Published, Scrape, families
from .server import MetricsServer

__all__ = [
    "HAMI",
    "LEGACY",
    "OWN",
    "Health",
    "KubeHealth",
    "Metric",
    "MetricsServer",
    "PodNames",
    "Published",
    "Scrape",
    "families",
]
