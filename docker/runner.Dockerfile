# A "host" running hicache-l3: the checkout installed (with Mooncake) into the Mooncake
# image's venv, the loopback shim preloaded (as an operator would for SGLang). Build
# context: the repository root (see .dockerignore). The C libraries are optional and there
# is no compiler here, so the pure-Python I/O path is used.
#   docker run --rm --network host IMAGE python -m hicache_l3.cli --help
ARG MOONCAKE_MASTER
FROM ${MOONCAKE_MASTER}
COPY pyproject.toml README.md /src/
COPY hicache_l3 /src/hicache_l3
RUN /opt/venv/bin/pip install --no-cache-dir --disable-pip-version-check -q '/src[mooncake]' \
 && rm -rf /src
ENTRYPOINT []
CMD ["python", "-m", "hicache_l3.cli", "--help"]
