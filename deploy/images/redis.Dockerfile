# redis:7.0.15 from Debian bookworm's packages (deploy/images/build.sh): redis-server, redis-cli
# and redis-sentinel, run as the official image runs them, from /data, protected mode off (the
# official image builds it off: the compose network is the boundary).
ARG BASE_IMAGE=rls-debian/bookworm:minbase
FROM ${BASE_IMAGE}
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server redis-tools redis-sentinel \
    && rm -rf /var/lib/apt/lists/* \
    && for server in redis-server redis-sentinel; do \
         printf '#!/bin/sh\nexec /usr/bin/%s "$@" --protected-mode no\n' "$server" > /usr/local/bin/$server; \
         chmod 755 /usr/local/bin/$server; \
       done \
    && mkdir /data && chown redis:redis /data
VOLUME /data
WORKDIR /data
USER redis
EXPOSE 6379
CMD ["redis-server"]
