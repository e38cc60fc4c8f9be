# The EPP image: `epp serve` on a slim Python base, as a non-root user.
#   docker build -t epp:0.1.0 .     (or: make image)
ARG PYTHON_VERSION=3.11

# Build the package and its dependencies into a self-contained virtualenv.
FROM python:${PYTHON_VERSION}-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY epp ./epp
RUN python -m venv /opt/epp && /opt/epp/bin/pip install .

# Runtime: the virtualenv only; no compilers, no pip cache, no source tree.
FROM python:${PYTHON_VERSION}-slim
RUN groupadd --gid 65532 epp && useradd --uid 65532 --gid 65532 --no-create-home --shell /usr/sbin/nologin epp
COPY --from=build /opt/epp /opt/epp
ENV PATH=/opt/epp/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
USER 65532:65532
# ext_proc gRPC, gRPC health (probes), Prometheus /metrics
EXPOSE 9002 9003 9090
ENTRYPOINT ["epp", "serve"]
