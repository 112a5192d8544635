# One image for every Riptide service: `docker run IMAGE serve <service> --config FILE`.
# Built without network by scripts/build_image.sh, from wheels it downloads beforehand into
# the build context (WHEELS; `pip install --no-index`). Any Debian-like BASE_IMAGE with
# python3.11 works: a base with bubblewrap, redis-server, git and procps already in it
# (scripts/build_base_image.sh makes one with debootstrap) needs no package mirror; others
# (python:3.11-slim) get them from apt. GPU engine nodes use a CUDA base and download the
# wheels with EXTRAS=daytona,sglang and TORCH_SPEC=<the CUDA torch build>.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG WHEELS=.riptide/image/wheels

# The sandbox's bubblewrap, Redis (the compose stack's redis service), git and ps (tasks).
RUN missing=""; \
    for pair in bwrap:bubblewrap redis-server:redis-server git:git ps:procps; do \
      command -v "${pair%%:*}" >/dev/null || missing="$missing ${pair##*:}"; \
    done; \
    if [ -n "$missing" ]; then \
      apt-get update && apt-get install -y --no-install-recommends $missing \
      && rm -rf /var/lib/apt/lists/*; \
    fi

# Dependencies first, in their own layer: source edits do not reinstall torch.
ENV VIRTUAL_ENV=/opt/riptide/venv PATH=/opt/riptide/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 PIP_NO_INDEX=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY ${WHEELS} /tmp/wheels
RUN python3 -m venv "$VIRTUAL_ENV" \
 && pip install --find-links /tmp/wheels -r /tmp/wheels/requirements.txt \
 && rm -rf /tmp/wheels

WORKDIR /opt/riptide
COPY pyproject.toml README.md ./
COPY services ./services
COPY protos ./protos
RUN pip install --no-deps --no-build-isolation . && rm -rf build *.egg-info \
 && riptide model create-tiny /opt/riptide/model
COPY tasks ./tasks
COPY deploy ./deploy

ENTRYPOINT ["riptide"]
CMD ["--help"]
