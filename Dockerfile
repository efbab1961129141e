# syntax=docker/dockerfile:1
# sloserve image. Self-contained: ONNX Runtime and the demo models are fetched
# (sha256-pinned, by scripts/fetch-*.sh) in the `deps` stage, so no `make
# setup` is needed before `docker build .`. Build with a version string:
#   docker build --build-arg VERSION="$(git describe --always --dirty)" -t sloserve .

# --- build: the Go binary (cgo is required by onnxruntime_go) ---------------
FROM golang:1.26-bookworm AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
ARG VERSION=dev
RUN CGO_ENABLED=1 go build -trimpath \
      -ldflags "-X github.com/sloserve/sloserve/server.Version=${VERSION}" \
      -o /out/sloserve ./cmd/sloserve

# --- deps: ONNX Runtime and demo model files from npm -----------------------
FROM node:20-bookworm-slim AS deps
WORKDIR /src
COPY scripts/ scripts/
# Configs only: .dockerignore keeps out any locally fetched version folders.
COPY demo-repository/ demo-repository/
RUN bash scripts/fetch-onnxruntime.sh && bash scripts/fetch-models.sh

# --- final: runtime only -----------------------------------------------------
FROM debian:bookworm-slim
RUN useradd --system --user-group --uid 10001 \
      --home-dir /opt/sloserve --no-create-home --shell /usr/sbin/nologin sloserve
COPY --from=build /out/sloserve /usr/local/bin/sloserve
COPY --from=deps /src/deps/onnxruntime/libonnxruntime.so.1.30.0 /opt/sloserve/lib/
COPY --from=deps /src/demo-repository/ /opt/sloserve/demo-repository/
RUN ln -s libonnxruntime.so.1.30.0 /opt/sloserve/lib/libonnxruntime.so \
 && chown sloserve:sloserve /opt/sloserve
ENV SLOSERVE_ONNXRUNTIME_LIBRARY=/opt/sloserve/lib/libonnxruntime.so.1.30.0
WORKDIR /opt/sloserve
# Non-root: with no writable cgroup the limiter enforces shares with what a
# process may do to its own runners (control.limiter auto picks
# "unprivileged": SCHED_IDLE, CPU affinity, RLIMIT_DATA; docs/deploy.md).
USER sloserve
# 8000 HTTP (OIP v2 REST), 8001 gRPC, 8002 Prometheus metrics.
EXPOSE 8000 8001 8002
# No curl in the image: bash's /dev/tcp sends the request, and the status
# line must say 200.
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
  CMD ["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/8000 && printf 'GET /v2/health/ready HTTP/1.0\\r\\nHost: localhost\\r\\n\\r\\n' >&3 && read -r -t 4 _ code _ <&3 && [ \"$code\" = 200 ]"]
ENTRYPOINT ["sloserve"]
CMD ["serve"]
