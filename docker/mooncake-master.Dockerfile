# Mooncake Store master with its embedded HTTP metadata server. Host networking only:
# every port is given on the command line and bound to 127.0.0.1 (the embedded metadata
# server binds 0.0.0.0 whatever it is told; see shared ENGINES notes / hicache_l3 engines).
#   docker run --rm --network host IMAGE --rpc_port=P --http_metadata_server_port=Q --metrics_port=R
ARG BASE
FROM ${BASE}
RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir --disable-pip-version-check -q \
      mooncake-transfer-engine-non-cuda==0.3.13.post1
# mooncake_master links libcurl (not in the wheel).
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libcurl4 >/dev/null \
 && rm -rf /var/lib/apt/lists/*
ENV PATH=/opt/venv/bin:$PATH MC_TCP_BIND_ADDRESS=127.0.0.1
ENTRYPOINT ["mooncake_master", "--rpc_address=127.0.0.1", "--enable_http_metadata_server=true", \
            "--http_metadata_server_host=127.0.0.1", "--metrics_host=127.0.0.1"]
CMD ["--rpc_port=50051", "--http_metadata_server_port=8080", "--metrics_port=9003"]
