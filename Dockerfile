# syntax=docker/dockerfile:1
# specgate: engine (`specgate serve`) and router (`specgate route`) in one
# image. Multi-stage: build in a Rust image, run in a slim one with only the
# binary, the scripts (fetch-models.sh for the init container) and configs.
#
# CPU (default):
#   docker build -t specgate:0.1.0 .
# The binary targets x86-64-v3 (AVX2), which candle's quantized kernels need
# to be fast; set TARGET_CPU=native for the build machine's CPU only, or
# x86-64 for any x86 CPU (slower).
#
# CUDA variant (documented, not built here): base the stages on NVIDIA's
# images and enable candle's CUDA backend, e.g.
#   docker build -t specgate:0.1.0-cuda \
#     --build-arg BUILD_IMAGE=nvidia/cuda:12.4.1-devel-ubuntu22.04 \
#     --build-arg RUN_IMAGE=nvidia/cuda:12.4.1-runtime-ubuntu22.04 \
#     --build-arg CARGO_FEATURES=cuda .
# and run with the NVIDIA container runtime (Kubernetes: the device plugin
# and `resources.limits: {nvidia.com/gpu: 1}` on the engine container).
# The CUDA images carry no Rust toolchain, so the build stage installs one
# with rustup when `cargo` is missing. The `cuda` cargo feature must exist
# in the workspace (it forwards to candle-core/cuda; see the GPU issue);
# the CPU build needs nothing of it.
#
# MPI variant (one model across hosts, deploy/lws/kimi-k3.yaml):
#   docker build -t specgate:0.1.0-mpi --build-arg CARGO_FEATURES=mpi .
# adds Open MPI and libclang (the `mpi` crate's bindings) to the build stage,
# and Open MPI's runtime, mpirun and ssh (its launcher) to the run stage.

ARG BUILD_IMAGE=rust:1-bookworm
ARG RUN_IMAGE=debian:bookworm-slim

FROM ${BUILD_IMAGE} AS build
ARG TARGET_CPU=x86-64-v3
ARG CARGO_FEATURES=
ENV PATH=/usr/local/cargo/bin:${PATH} CARGO_HOME=/usr/local/cargo RUSTUP_HOME=/usr/local/rustup
RUN if ! command -v cargo >/dev/null; then \
      apt-get update && apt-get install -y --no-install-recommends curl ca-certificates build-essential pkg-config && \
      curl -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal --no-modify-path; \
    fi
RUN case ",${CARGO_FEATURES}," in *,mpi,*) \
      apt-get update && apt-get install -y --no-install-recommends libopenmpi-dev libclang-dev && \
      rm -rf /var/lib/apt/lists/* ;; \
    esac
WORKDIR /src
COPY . .
# RUSTFLAGS overrides .cargo/config.toml's target-cpu=native, which would
# tie the image to the build machine's CPU. Only the server package is
# built: the load generator (loadgen/, specgate-bench) is not in the image.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    RUSTFLAGS="-C target-cpu=${TARGET_CPU}" \
    cargo build --release --locked -p specgate --bin specgate \
      ${CARGO_FEATURES:+--features "$CARGO_FEATURES"} && \
    cp target/release/specgate /usr/local/bin/specgate

FROM ${RUN_IMAGE}
ARG CARGO_FEATURES=
# python3 + pip + coreutils: scripts/fetch-models.sh (the init container);
# with the mpi feature also Open MPI (libmpi, mpirun) and ssh for its launcher.
RUN apt-get update && \
    apt-get install -y --no-install-recommends python3 python3-pip ca-certificates && \
    case ",${CARGO_FEATURES}," in *,mpi,*) \
      apt-get install -y --no-install-recommends openmpi-bin openssh-server openssh-client ;; \
    esac && \
    rm -rf /var/lib/apt/lists/* && \
    useradd --uid 10001 --create-home specgate
COPY --from=build /usr/local/bin/specgate /usr/local/bin/specgate
COPY scripts /opt/specgate/scripts
COPY configs /opt/specgate/configs
USER 10001
WORKDIR /opt/specgate
EXPOSE 8000 8080
ENTRYPOINT ["/usr/local/bin/specgate"]
CMD ["serve", "--config", "/opt/specgate/configs/default.toml"]
