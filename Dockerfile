# pipec with CUDA and MPI, for clusters and Kubernetes.
#
#   docker build -t pipec .
#   docker run --gpus all -v "$PWD:/work" -w /work pipec run specs/1f1b.yaml --backend cuda
#
# Nothing CUDA is linked at build time (cudarc loads the driver and NVRTC when the `cuda`
# backend starts), so the builder is plain Debian; the runtime image brings NVRTC, the
# NVIDIA container toolkit the driver. Open MPI is linked (the `mpi` feature): run ranks
# with the image's `mpirun`, or without MPI through torchrun's variables
# (`pipec run --transport tcp`, docs/multi-host.md). See docs/multi-host.md, "Containers".

# --- build: Debian bookworm (glibc 2.36), Rust, Open MPI headers, libclang for bindgen ----
FROM rust:1.92-bookworm AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends libopenmpi-dev clang libclang-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --release --locked --features cuda,mpi \
 && strip target/release/pipec \
 && cp target/release/pipec /usr/local/bin/pipec

# --- run: CUDA's runtime libraries (NVRTC) on Ubuntu 24.04 (glibc 2.39), Open MPI -----------
FROM nvidia/cuda:12.6.3-runtime-ubuntu24.04
RUN apt-get update \
 && apt-get install -y --no-install-recommends openmpi-bin libopenmpi3t64 openssh-client \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /usr/local/bin/pipec /usr/local/bin/pipec
COPY specs /opt/pipec/specs
# Open MPI refuses to run as root unless told; containers usually are root
ENV OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
ENTRYPOINT ["pipec"]
CMD ["--help"]
