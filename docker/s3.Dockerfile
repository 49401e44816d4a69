# The local S3 server for NIXL's OBJ plugin: moto's server on 127.0.0.1 (host networking).
#   docker run --rm --network host IMAGE -p PORT
ARG BASE
FROM ${BASE}
RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir --disable-pip-version-check -q 'moto[server]>=5,<6'
ENV PATH=/opt/venv/bin:$PATH
ENTRYPOINT ["moto_server", "-H", "127.0.0.1"]
CMD ["-p", "5000"]
