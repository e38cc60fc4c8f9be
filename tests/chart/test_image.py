"""The Dockerfile, checked without a Docker engine (none runs here): what `make image` builds."""

from __future__ import annotations

import re

from tests.chart.conftest import ROOT, CHART

DOCKERFILE = (ROOT / "Dockerfile").read_text()


def instructions(name: str) -> list[str]:
    return [line.split(None, 1)[1] for line in DOCKERFILE.splitlines() if line.upper().startswith(name + " ")]


def test_slim_base_non_root_ports_and_entrypoint() -> None:
    assert all("-slim" in base for base in instructions("FROM"))
    [user] = instructions("USER")
    assert user.split(":")[0] not in ("root", "0")
    assert set(" ".join(instructions("EXPOSE")).split()) == {"9002", "9003", "9090"}
    assert instructions("ENTRYPOINT") == ['["epp", "serve"]']


def test_build_context_has_what_the_dockerfile_copies() -> None:
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    assert "*" in ignore  # everything is excluded unless re-included
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    for copy in instructions("COPY"):
        if copy.startswith("--from"):
            continue
        *sources, _ = copy.split()
        for source in sources:
            assert source.rstrip("/") in allowed, f"{source} is excluded by .dockerignore"
            assert (ROOT / source).exists()


def test_chart_runs_the_image_user_and_tag() -> None:
    user = instructions("USER")[0].split(":")[0]
    deployment = (CHART / "templates" / "epp-deployment.yaml").read_text()
    assert re.search(rf"runAsUser: {user}\b", deployment)
    version = re.search(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    chart = (CHART / "Chart.yaml").read_text()
    assert version and f'appVersion: "{version.group(1)}"' in chart  # the default image tag is the package version
