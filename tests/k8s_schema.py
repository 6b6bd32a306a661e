"""Strict validation of Kubernetes objects with kubernetes-validate's bundled OpenAPI schemas:
for Kubernetes 1.29 (the oldest release the manifests and the chart support) and the newest
release the installed kubernetes-validate knows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate

OLDEST = "1.29"


def newest() -> str:
    schemas = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    versions = [
        tuple(int(x) for x in d.name.removeprefix("v").split("-")[0].split(".")[:2])
        for d in schemas.iterdir()
        if d.name.endswith("-local-strict")
    ]
    major, minor = max(versions)
    return f"{major}.{minor}"


VERSIONS = (OLDEST, newest())


def validate(doc: dict[str, Any], version: str) -> None:
    """Raises kubernetes_validate.ValidationError (unknown fields included) or returns."""
    assert kubernetes_validate.validate(doc, version, strict=True) == version
