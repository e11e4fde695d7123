"""Fixture `builds`: every kustomization under deploy/kubernetes rendered once per session."""

from __future__ import annotations

import pytest

from tests.deploy.kube import BUILDS, Doc, kustomize


@pytest.fixture(scope="session")
def builds() -> dict[str, list[Doc]]:
    return {build: kustomize(build) for build in BUILDS}
