# prom/prometheus:v2.42.0's equivalent from Debian bookworm's prometheus package (2.42.0, built by
# deploy/images/build.sh): the same entrypoint, user, working directory and default arguments.
ARG BASE_IMAGE=rls-debian/bookworm:minbase
FROM ${BASE_IMAGE}
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir /prometheus && chown nobody:nogroup /prometheus
VOLUME /prometheus
WORKDIR /prometheus
USER nobody
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
