# A Mooncake segment holder (mooncake_client): contributes a memory segment to a master,
# so pages outlive every connector. Built FROM the master image (same mooncake install,
# loopback shim preloaded).
#   docker run --rm --network host IMAGE --global_segment_size="1 GB" --port=P \
#     --master_server_address=127.0.0.1:RPC --metadata_server=http://127.0.0.1:Q/metadata
ARG MOONCAKE_MASTER
FROM ${MOONCAKE_MASTER}
ENTRYPOINT ["mooncake_client", "--host=127.0.0.1"]
CMD []
