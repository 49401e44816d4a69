# Mooncake Store master, with hicache-l3's loopback metadata server (the master's embedded
# one binds 0.0.0.0 whatever it is told: hicache_l3/engines/mooncake_metadata.py) and the loopback
# shim preloaded into every process of this image and the images built FROM it (Mooncake's
# transfer engine listens on 0.0.0.0/[::] with no setting: hicache_l3/engines/loopback_bind.c).
# Build context: the repository root. Host networking; every port on the command line:
#   docker run --rm --network host --entrypoint python3 IMAGE /opt/hicache-l3/mooncake_metadata.py --port=Q
#   docker run --rm --network host IMAGE --rpc_port=P --metrics_port=R
# (clients then use metadata_server = http://127.0.0.1:Q/metadata)
ARG BASE
FROM ${BASE} AS shim
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends gcc libc6-dev >/dev/null
COPY hicache_l3/engines/loopback_bind.c /src/
RUN gcc -O2 -Wall -Wextra -shared -fPIC -o /src/loopback_bind.so /src/loopback_bind.c -ldl

FROM ${BASE}
RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir --disable-pip-version-check -q \
      mooncake-transfer-engine-non-cuda==0.3.13.post1
# mooncake_master links libcurl (not in the wheel).
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libcurl4 >/dev/null \
 && rm -rf /var/lib/apt/lists/*
COPY --from=shim /src/loopback_bind.so /opt/hicache-l3/loopback_bind.so
COPY hicache_l3/engines/mooncake_metadata.py /opt/hicache-l3/mooncake_metadata.py
ENV PATH=/opt/venv/bin:$PATH MC_TCP_BIND_ADDRESS=127.0.0.1 LD_PRELOAD=/opt/hicache-l3/loopback_bind.so
ENTRYPOINT ["mooncake_master", "--rpc_address=127.0.0.1", "--enable_http_metadata_server=false", \
            "--metrics_host=127.0.0.1"]
CMD ["--rpc_port=50051", "--metrics_port=9003"]
