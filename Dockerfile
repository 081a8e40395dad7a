# syntax=docker/dockerfile:1
# The Offload image: job_controller, cpu_optimizer_server, gpu_trainer and offloadctl in
# /opt/offload/bin, the demo corpus in /opt/offload/data, running as uid 10001. k8s/ runs it.
#
#   scripts/build-image                                           # from the build tree (below)
#   docker build -t offload:0.1.0 .                              # compiles: CPU backend only
#   docker build --build-arg CUDA_VERSION=13-0 -t offload:0.1.0 .  # compiles: with the CUDA backend
#
# Where the programs come from (PROGRAMS):
# - `source` (the default) compiles them in the `source` stage, from a clean checkout.
# - `prebuilt` takes what scripts/build-image staged in build/image/: the programs of the Release
#   build tree the tests already built (so a 2-core machine does not compile the project twice)
#   and, when that tree has the CUDA backend, the CUDA libraries they link (build/image/lib).
# Only the chosen stage is built. Either way the last stage holds the runtime libraries only.
#
# The CUDA backend needs nvcc at build time: CUDA_VERSION (NVIDIA's package suffix, e.g. 13-0)
# adds NVIDIA's CUDA repository for Debian 12 and its compiler, cuBLAS and runtime packages.
# Without it the `source` trainer has only the CPU backend (a job with training.device=cuda
# fails). The GPU driver (libcuda) comes from the node through the NVIDIA container toolkit.
#
# tests/container_test.sh builds it (prebuilt) and runs the manifests' commands in it;
# tests/k8s_manifests_test.sh checks that it installs what the manifests run.

ARG DEBIAN_IMAGE=debian:12
ARG PROGRAMS=source

FROM ${DEBIAN_IMAGE} AS source
ARG CUDA_VERSION=""
ENV DEBIAN_FRONTEND=noninteractive
# The build packages: the same list ./scripts/build installs (scripts/bootstrap).
COPY scripts/bootstrap /tmp/bootstrap
RUN apt-get update -q \
 && apt-get install -y -q --no-install-recommends ca-certificates curl \
 && /tmp/bootstrap \
 && if [ -n "$CUDA_VERSION" ]; then \
      curl -fsSL -o /tmp/cuda-keyring.deb \
        https://developer.download.nvidia.com/compute/cuda/repos/debian12/x86_64/cuda-keyring_1.1-1_all.deb \
      && dpkg -i /tmp/cuda-keyring.deb && apt-get update -q \
      && apt-get install -y -q --no-install-recommends "cuda-nvcc-$CUDA_VERSION" \
           "cuda-cudart-dev-$CUDA_VERSION" "libcublas-dev-$CUDA_VERSION"; \
    fi \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# OFF without CUDA_VERSION, so a CPU-only image is a deliberate choice, not a missing nvcc.
RUN if [ -n "$CUDA_VERSION" ]; then \
      cuda="-DOFFLOAD_CUDA=ON -DCMAKE_CUDA_COMPILER=/usr/local/cuda-$(echo "$CUDA_VERSION" | tr - .)/bin/nvcc"; \
    else \
      cuda="-DOFFLOAD_CUDA=OFF"; \
    fi \
 && cmake -S . -B /build -G Ninja -DCMAKE_BUILD_TYPE=Release $cuda \
 && cmake --build /build -j "$(nproc)" \
      --target job_controller cpu_optimizer_server gpu_trainer offloadctl offload_c \
 && mkdir -p /out/bin /out/lib /out/pylib \
 && cp /build/bin/job_controller /build/bin/cpu_optimizer_server /build/bin/gpu_trainer \
       /build/bin/offloadctl /out/bin/ \
 && cp /build/lib/liboffload_c.so /out/pylib/ \
 && strip --strip-unneeded /out/bin/* /out/pylib/*

# scripts/build-image's staging: bin/ (stripped programs), lib/ (CUDA libraries, or empty),
# pylib/ (liboffload_c.so, for the torch image).
FROM scratch AS prebuilt
COPY build/image/bin/ /out/bin/
COPY build/image/lib/ /out/lib/
COPY build/image/pylib/ /out/pylib/

FROM ${PROGRAMS} AS programs

FROM ${DEBIAN_IMAGE} AS runtime
ARG CUDA_VERSION=""
ENV DEBIAN_FRONTEND=noninteractive
# Runtime libraries only (those of the -dev packages in scripts/bootstrap); ibverbs-providers
# and librdmacm1, UCX's way to RDMA NICs (k8s/overlays/rdma), are named though libucx0 pulls them.
# apt-get clean: the base scripts/build-image makes with mmdebstrap lacks the docker-clean hook of
# Docker's debian image, so the downloaded packages would otherwise stay in the layer.
RUN apt-get update -q \
 && apt-get install -y -q --no-install-recommends ca-certificates \
      libabsl20220623 libgrpc++1.51 libgrpc29 libprotobuf32 libopenblas0-openmp libgomp1 \
      libucx0 libgloo0 libsqlite3-0 libcpp-httplib0.11 libyaml-cpp0.7 libgoogle-glog0v6 \
      libprometheus-cpp-core1.0 liburing2 zlib1g \
      ibverbs-providers librdmacm1 \
 && if [ -n "$CUDA_VERSION" ]; then \
      apt-get install -y -q --no-install-recommends curl \
      && curl -fsSL -o /tmp/cuda-keyring.deb \
        https://developer.download.nvidia.com/compute/cuda/repos/debian12/x86_64/cuda-keyring_1.1-1_all.deb \
      && dpkg -i /tmp/cuda-keyring.deb && rm /tmp/cuda-keyring.deb && apt-get update -q \
      && apt-get install -y -q --no-install-recommends "cuda-cudart-$CUDA_VERSION" "libcublas-$CUDA_VERSION" \
      && echo "/usr/local/cuda-$(echo "$CUDA_VERSION" | tr - .)/targets/x86_64-linux/lib" \
           > /etc/ld.so.conf.d/offload-cuda.conf \
      && ldconfig \
      && apt-get purge -y curl && apt-get autoremove -y; \
    fi \
 && apt-get clean && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 offload \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin offload
COPY --from=programs /out/bin/ /opt/offload/bin/
COPY --from=programs /out/lib/ /opt/offload/lib/
RUN echo /opt/offload/lib > /etc/ld.so.conf.d/offload.conf && ldconfig
COPY data/tinyshakespeare.txt /opt/offload/data/tinyshakespeare.txt
# Every library resolves (libcuda, the driver, is mounted into GPU containers at run time).
RUN ! ldd /opt/offload/bin/* | grep -v 'libcuda\.so' | grep 'not found'
ENV PATH=/opt/offload/bin:$PATH
# The pods mount an emptyDir at /tmp under a read-only root filesystem.
WORKDIR /tmp
USER 10001:10001
CMD ["job_controller", "--help"]

# The trainer image for torch jobs (k8s/overlays/torch; --target torch, scripts/build-image
# --torch): the runtime image plus Debian's python3-torch and the offload package, laid out as
# the wheel of scripts/build-wheel lays it out (offload/lib/liboffload_c.so, offload/bin/), and
# the example script. A second image because torch is most of its size: the controller and the
# optimizer servers do not need it. Debian's torch is a CPU build; for CUDA, build this stage
# FROM an image with a CUDA torch instead.
FROM runtime AS torch
USER root
RUN apt-get update -q \
 && apt-get install -y -q --no-install-recommends python3 python3-torch python3-numpy \
 && apt-get clean && rm -rf /var/lib/apt/lists/*
# The package with its subpackages (offload.hf); .dockerignore leaves out __pycache__.
COPY python/offload/ /usr/lib/python3/dist-packages/offload/
COPY --from=programs /out/pylib/liboffload_c.so /usr/lib/python3/dist-packages/offload/lib/
RUN mkdir -p /usr/lib/python3/dist-packages/offload/bin \
 && ln -s /opt/offload/bin/cpu_optimizer_server /usr/lib/python3/dist-packages/offload/bin/
COPY examples/torch_job.py /opt/offload/examples/torch_job.py
# A read-only root: no .pyc written next to the sources, and what scripts cache under ~ (torch.hub,
# datasets) goes to the pods' /tmp emptyDir: uid 10001 has no home.
ENV PYTHONDONTWRITEBYTECODE=1 HOME=/tmp
RUN ! ldd /usr/lib/python3/dist-packages/offload/lib/liboffload_c.so \
      | grep -v 'libcuda\.so' | grep 'not found' \
 && python3 -c 'import offload.torch, offload.hf, offload.native as l; print(l.library_path(), l.server_binary())'
USER 10001:10001

# The default target: the image of the controller, the optimizer servers and the C++ trainer.
FROM runtime
