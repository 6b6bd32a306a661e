# One image for every hami-usage command (collect, aggregate, replay, simulate, ...):
#   docker build -t hami-usage .
#   docker run --rm hami-usage --help
# The Kubernetes manifests (deploy/) and docker-compose.yml pass the subcommand as arguments.
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
# Only what the package build needs (.dockerignore keeps the rest of the tree out of the context).
COPY pyproject.toml README.md ./
COPY collector ./collector
# The runtime dependencies only: no [test] extras.
RUN pip install . \
    && rm -rf /src

# A fixed numeric uid, so Kubernetes can verify runAsNonRoot; the manifests use the same one.
# The data folders are created owned by it: an empty named Docker volume mounted on one of them
# takes the folder's ownership, so docker-compose needs no chown.
RUN groupadd --system --gid 10001 hami \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin hami \
    && install -d -o 10001 -g 10001 /var/lib/hami-usage /var/lib/hami-usage/events \
       /data/containers /data/spool /out

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
WORKDIR /
ENTRYPOINT ["hami-usage"]
CMD ["--help"]
