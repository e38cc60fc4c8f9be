"""Where the EPP finds its apiserver and its namespace.

Order of configuration, as controller-runtime does it: the `--kubeconfig` flag, the in-cluster
service account, the KUBECONFIG variable, then ~/.kube/config. Namespace: the flag, then the
NAMESPACE variable (the chart sets it from the downward API), then "default".
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the client is imported lazily: static mode never loads it
    from kubernetes.client import ApiClient

log = logging.getLogger("epp.discovery")


class KubeConfigError(RuntimeError):
    """No usable apiserver configuration was found."""


def resolve_namespace(flag: str = "") -> str:
    return flag or os.environ.get("NAMESPACE", "") or "default"


def api_client(kubeconfig: str = "") -> ApiClient:
    """An ApiClient for the first configuration source that exists (see the module doc)."""
    from kubernetes import client, config
    from kubernetes.config.config_exception import ConfigException

    configuration = client.Configuration()
    source = kubeconfig
    try:
        if kubeconfig:
            config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
        else:
            try:
                config.load_incluster_config(client_configuration=configuration)
                source = "in-cluster service account"
            except ConfigException:
                source = os.environ.get("KUBECONFIG", "").split(os.pathsep)[0] or str(Path.home() / ".kube" / "config")
                if not Path(source).exists():
                    raise KubeConfigError("no Kubernetes configuration: not running in a cluster, and no "
                                          f"--kubeconfig, KUBECONFIG or {source}") from None
                config.load_kube_config(config_file=source, client_configuration=configuration)
    except (ConfigException, OSError, ValueError) as exc:
        raise KubeConfigError(f"cannot use Kubernetes configuration {source}: {exc}") from None
    log.info("kubernetes api %s (from %s)", configuration.host, source)
    return client.ApiClient(configuration)
