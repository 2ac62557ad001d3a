# syntax=docker/dockerfile:1
# One image for every Quayutec service. Each Kubernetes workload sets its own command:
#   python -m services.gateway | services.room | services.claims | services.runtime
#   python -m quayutec.migrate   (the migrations Job)
ARG PYTHON_IMAGE=python:3.11-slim

# --- build: install the project and its dependencies into a self-contained venv ---
FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY . .
RUN pip install --no-cache-dir .

# --- runtime: no source tree, no build leftovers, a non-root user ---
FROM ${PYTHON_IMAGE}
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    QUAYUTEC_DATA_DIR=/tmp/quayutec
RUN groupadd --system --gid 10001 quayutec \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /tmp \
      --shell /usr/sbin/nologin quayutec
COPY --from=build /opt/venv /opt/venv
WORKDIR /tmp
# Numeric user so Kubernetes' runAsNonRoot can verify it without reading /etc/passwd.
USER 10001:10001
# Every port a service of ours listens on as deploy/k8s runs it: the four services, the Gateway's console port,
# the console's HTTP and the plaintext health port (tests/test_deploy.py checks it against the manifests).
EXPOSE 50051 50052 50053 50054 50055 8080 8081
# Harmless default: every Deployment/Job sets its own command.
CMD ["python", "-c", "print('quayutec image: run python -m services.<gateway|room|claims|runtime> or python -m quayutec.migrate')"]
