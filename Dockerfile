# kv-prefix-indexer: the HTTP service (`kv-indexer serve`), one uvicorn worker per container.
# Build: docker build -t kv-prefix-indexer:0.1.0 .
# Run:   docker run -p 8080:8080 kv-prefix-indexer:0.1.0 --demo

# --- build: a wheel of the project and of every runtime dependency --------------------
FROM python:3.11-slim AS build
# gcc builds the compiled extensions (indexer/_native/*.c, api/_surface.c) into the project's wheel.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md MANIFEST.in ./
COPY indexer ./indexer
COPY api ./api
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

# --- runtime: the wheels only, no compiler, no source tree, a non-root user ----------
FROM python:3.11-slim
RUN useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin kvi
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links=/wheels kv-prefix-indexer && rm -rf /wheels
USER 10001
ENV PYTHONUNBUFFERED=1 \
    KVI_HOST=0.0.0.0 \
    KVI_PORT=8080 \
    KVI_LOG_JSON=true
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=2s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request as u; sys.exit(u.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('KVI_PORT', '8080'), timeout=2).status != 200)"]
ENTRYPOINT ["kv-indexer", "serve"]
