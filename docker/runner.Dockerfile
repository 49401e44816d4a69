# A "host" running hicache-l3: the checkout built into a wheel (its C extensions are
# required, so the build stage has a compiler and Python's headers) and installed, with
# Mooncake, into the Mooncake image's venv, the loopback shim preloaded (as an operator would
# for SGLang). Build context: the repository root (see .dockerignore).
#   docker run --rm --network host IMAGE python -m hicache_l3.cli --help
ARG MOONCAKE_MASTER
FROM ${MOONCAKE_MASTER} AS build
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends gcc libc6-dev python3-dev >/dev/null
COPY pyproject.toml README.md /src/
COPY hicache_l3 /src/hicache_l3
RUN /opt/venv/bin/pip wheel --no-cache-dir --disable-pip-version-check -q --no-deps -w /wheels /src

FROM ${MOONCAKE_MASTER}
COPY --from=build /wheels /wheels
RUN /opt/venv/bin/pip install --no-cache-dir --disable-pip-version-check -q "$(ls /wheels/hicache_l3-*.whl)[mooncake]" \
 && rm -rf /wheels
ENTRYPOINT []
CMD ["python", "-m", "hicache_l3.cli", "--help"]
