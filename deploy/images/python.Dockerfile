# What deploy/Dockerfile needs of python:3.11.7-slim-bookworm, from Debian bookworm's packages
# (Python 3.11, built by deploy/images/build.sh): `python`, `pip` installing into the system
# (the official image has no EXTERNALLY-MANAGED marker either) and `useradd`.
ARG BASE_IMAGE=rls-debian/bookworm:minbase
FROM ${BASE_IMAGE}
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-pip python-is-python3 \
    && rm -rf /var/lib/apt/lists/* /usr/lib/python3*/EXTERNALLY-MANAGED
CMD ["python3"]
