# pinfeed: the node-local batch server (and, in docker-compose.yml, the trainer example).
#
#   CPU image (default):  docker build -t pinfeed:cpu .
#   CUDA image:           docker build -t pinfeed:cuda \
#                           --build-arg TORCH_INDEX_URL=https://pypi.org/simple .
#                         (PyPI's Linux torch wheels are CUDA builds; or name a
#                         download.pytorch.org/whl/cuXXX index for another CUDA version)
#
# The server itself never touches CUDA (trainers register the ring with CUDA), so the
# CPU image is the right one for `pinfeed serve` even on GPU nodes; trainers that run
# from this image need the CUDA build. PyTorch's CUDA wheels bundle the CUDA runtime,
# so the slim Python base works for both; the NVIDIA container toolkit brings the driver.
# PYTHON_IMAGE may name any Debian-based image with Python >= 3.11 on PATH as `python`
# (deploy/local/base-image.sh makes one with debootstrap where no registry is reachable).
#
# Behind a proxy or offline, point pip at a mirror or a wheelhouse on the build host
# (with `docker build --network host` for one on loopback):
#   --build-arg PIP_INDEX_URL=http://127.0.0.1:8080/simple
#   --build-arg TORCH_INDEX_URL=http://127.0.0.1:8080/simple
# and, for a mirror whose TLS certificate a private CA signs, put that CA's PEM file in
# deploy/ca/ (copied into the build stage only; see deploy/ca/README.md).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---------------------------------------------------------------------------- build
FROM ${PYTHON_IMAGE} AS build

# torch from the index chosen at build time: the CPU index by default; a CUDA index
# (download.pytorch.org/whl/cuXXX, or PyPI itself, whose Linux wheels are CUDA builds)
# for a CUDA image. Keep TORCH_VERSION in step with TORCH_SPEC in the Makefile.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# pip reads PIP_INDEX_URL from the environment: every other dependency comes from it.
ARG PIP_INDEX_URL=https://pypi.org/simple

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PATH=/opt/venv/bin:$PATH

# Extra CA certificates for pip (a corporate proxy or a private mirror), build stage only.
COPY deploy/ca/ /tmp/ca/
RUN cat /etc/ssl/certs/ca-certificates.crt /tmp/ca/*.pem > /tmp/pip-ca.crt 2>/dev/null \
    || cp /etc/ssl/certs/ca-certificates.crt /tmp/pip-ca.crt
ENV PIP_CERT=/tmp/pip-ca.crt

# Then trim what neither the server nor a trainer running from this image reads: C++
# headers, CMake files and static libraries (a trainer that needs torch.compile's C++
# toolchain builds its own image and installs only `pinfeed`).
RUN python -m venv /opt/venv \
    && pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
    && site=$(python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") \
    && rm -rf "$site"/torch/include "$site"/torch/share/cmake "$site"/torch/lib/*.a

WORKDIR /src

# The other dependencies, read from pyproject.toml alone: editing the source does not
# invalidate this layer, only changing the dependency list does.
# PINFEED_EXTRAS: the extras to install, comma-separated (server,ray for the Ray executor).
ARG PINFEED_EXTRAS=server
COPY pyproject.toml README.md ./
RUN python -c "import os, tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; x = [d for e in os.environ['PINFEED_EXTRAS'].split(',') for d in p['optional-dependencies'][e] if not d.startswith('pinfeed[')]; print('\n'.join(p['dependencies'] + x))" > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt

# The source last; --no-deps because everything it needs is installed above.
COPY src/ src/
RUN pip install --no-deps . \
    && pip check

# -------------------------------------------------------------------------- runtime
FROM ${PYTHON_IMAGE} AS runtime

# One fixed uid for the server and every trainer that shares its socket: the data
# plane accepts peers with the server's own uid (or root) only.
ARG PINFEED_UID=10001

LABEL org.opencontainers.image.title="pinfeed" \
      org.opencontainers.image.description="Node-local batch server for PyTorch trainers" \
      org.opencontainers.image.licenses="Apache-2.0"

# No apt packages: the healthcheck uses Python's urllib, not curl.
# The socket dir is created 0700 and owned by the service user; a named volume
# mounted there starts with this owner and mode.
RUN groupadd --system --gid "${PINFEED_UID}" pinfeed \
    && useradd --system --uid "${PINFEED_UID}" --gid pinfeed --no-create-home \
       --home-dir /var/lib/pinfeed --shell /usr/sbin/nologin pinfeed \
    && mkdir -p /var/lib/pinfeed /run/pinfeed /data \
    && chown pinfeed:pinfeed /var/lib/pinfeed /run/pinfeed \
    && chmod 0700 /var/lib/pinfeed /run/pinfeed

COPY --from=build /opt/venv /opt/venv

WORKDIR /app
COPY examples/ examples/

# Inside the container the control plane binds all interfaces (the container's own
# network namespace); publish it on the host's loopback only and set PINFEED_TOKEN.
# No secret is baked in: PINFEED_TOKEN comes from the environment at run time.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PINFEED_HOST=0.0.0.0 \
    PINFEED_PORT=8321 \
    PINFEED_RUN_DIR=/run/pinfeed \
    PINFEED_SOCKET=/run/pinfeed/pinfeed.sock \
    PINFEED_STATE_DIR=/var/lib/pinfeed \
    PINFEED_DATA_ROOT=/data

VOLUME ["/var/lib/pinfeed", "/run/pinfeed"]
EXPOSE 8321
# Numeric, so that Kubernetes' runAsNonRoot can verify it without /etc/passwd.
USER ${PINFEED_UID}:${PINFEED_UID}

HEALTHCHECK --interval=5s --timeout=3s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request as u; u.urlopen('http://127.0.0.1:' + os.environ.get('PINFEED_PORT', '8321') + '/healthz', timeout=2)"]

STOPSIGNAL SIGTERM
ENTRYPOINT ["pinfeed", "serve"]
