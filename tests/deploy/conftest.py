"""The deploy tests' fixtures: deploy/k8s's kustomization and its objects, read once per module."""

from __future__ import annotations

import pytest

from tests.support.k8s_manifests import load_kustomization, load_objects


@pytest.fixture(scope="module")
def kustomization() -> dict:
    return load_kustomization()


@pytest.fixture(scope="module")
def objects(kustomization) -> dict[tuple[str, str], dict]:
    """(kind, name) -> manifest, from every resource the kustomization lists."""
    return load_objects(kustomization)
