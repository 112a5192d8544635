# One image for every Riptide service: `docker run IMAGE serve <service> --config FILE`.
# GPU engine nodes build FROM a CUDA base with SGLang: --build-arg BASE_IMAGE=... and
# --build-arg EXTRAS=daytona,sglang --build-arg TORCH_SPEC=<the CUDA torch build>.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_SPEC=torch==2.13.0
ARG EXTRAS=daytona

RUN apt-get update \
 && apt-get install -y --no-install-recommends bubblewrap git procps redis-server \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/riptide
COPY pyproject.toml README.md ./
COPY services ./services
COPY protos ./protos
RUN pip install --no-cache-dir "${TORCH_SPEC}" \
 && pip install --no-cache-dir ".[${EXTRAS}]"
COPY tasks ./tasks
COPY deploy ./deploy

ENTRYPOINT ["riptide"]
CMD ["--help"]
