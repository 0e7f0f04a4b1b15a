# epfabricd + epctl image. Two stages:
#   build:   Debian 12 + NVIDIA's CUDA toolkit (Debian 12 repository), then exactly `scripts/epf deps`,
#            `scripts/epf install` (which runs `scripts/epf build`) and `scripts/epf runtime-packages`: no second recipe
#            (tests/deploy/dockerfile_test.sh checks it).
#   runtime: Debian 12 slim with the installed tree (the install() rules) and the Debian libraries it loads; runs as
#            a non-root user. The CUDA driver (libcuda, NVML) comes from the host through the NVIDIA container toolkit.
#
#   podman build -t epfabric .          (or buildah bud / docker build)
#   podman run --rm epfabric --help
ARG DEBIAN_IMAGE=docker.io/library/debian:12
ARG RUNTIME_IMAGE=docker.io/library/debian:12-slim

FROM ${DEBIAN_IMAGE} AS build
# CUDA toolkit release as Debian package suffix (cuda-minimal-build-13-0 = CUDA 13.0), and the GPU architectures.
ARG CUDA_PACKAGE_VERSION=13-0
ARG EPF_JOBS=4
ENV CUDA_HOME=/usr/local/cuda DEBIAN_FRONTEND=noninteractive
RUN apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends ca-certificates wget \
 && wget -q https://developer.download.nvidia.com/compute/cuda/repos/debian12/x86_64/cuda-keyring_1.1-1_all.deb \
 && dpkg -i cuda-keyring_1.1-1_all.deb && rm cuda-keyring_1.1-1_all.deb \
 && apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends cuda-minimal-build-${CUDA_PACKAGE_VERSION} \
 && rm -rf /var/lib/apt/lists/* \
 && { [ -e /usr/local/cuda ] || ln -s "$(ls -d /usr/local/cuda-* | sort -V | tail -1)" /usr/local/cuda; }
WORKDIR /src
COPY . .
RUN scripts/epf deps
RUN EPF_JOBS=${EPF_JOBS} EPF_BUILD_DIR=/build scripts/epf install /opt/epfabric
RUN mkdir -p /opt/epfabric/share/epfabric \
 && scripts/epf runtime-packages /opt/epfabric/bin /opt/epfabric/lib > /opt/epfabric/share/epfabric/runtime-packages.txt

FROM ${RUNTIME_IMAGE} AS runtime
COPY --from=build /opt/epfabric /opt/epfabric
RUN apt-get update -qq \
 && xargs -a /opt/epfabric/share/epfabric/runtime-packages.txt \
      env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 epfabric \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin epfabric \
 && mkdir -p /run/epfabric && chown 10001:10001 /run/epfabric && chmod 0750 /run/epfabric
# EPFABRIC_SOCKET: the socket epctl (and the Python package) use when given none.
ENV PATH=/opt/epfabric/bin:$PATH \
    LD_LIBRARY_PATH=/opt/epfabric/lib \
    EPFABRIC_SOCKET=/run/epfabric/epfabricd.sock
USER 10001:10001
# 7000: peer port (--peer_listen), 9400: Prometheus (--metrics_listen); both only when the flags say so.
EXPOSE 7000 9400
HEALTHCHECK --interval=10s --timeout=5s --start-period=10s --retries=3 \
  CMD epctl --timeout_ms=3000 health || exit 1
# One daemon (--world_size=1): no peer, no credential to provide. tests/deploy/pod_harness.py runs this command.
ENTRYPOINT ["epfabricd"]
CMD ["--client_socket=/run/epfabric/epfabricd.sock"]
