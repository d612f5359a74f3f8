# syntax=docker/dockerfile:1
# The fencegate image: the proxy (`run`, the default command), the injector (`webhook`) and
# the tools (`check`, `ttl`, `inject`) in one static-enough binary on distroless.
#
#   docker build -t ghcr.io/fencegate/fencegate:0.1.0 .
#   docker run --rm -v "$PWD/config:/etc/fencegate:ro" -p 7440:7440 -p 7441:7441 \
#     ghcr.io/fencegate/fencegate:0.1.0

FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
# Cache mounts keep the registry and the build directory between builds; the binary is
# copied out in the same step because the target cache is not part of the image.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin fencegate \
    && install -D -m 0755 target/release/fencegate /out/usr/local/bin/fencegate \
    && install -d -m 0750 /out/var/lib/fencegate

# glibc and libgcc for the Rust binary, nothing else: no shell, no package manager.
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /out/usr/local/bin/fencegate /usr/local/bin/fencegate
# The embedded store's default directory, writable by the nonroot user (Kubernetes mounts
# an emptyDir or a volume claim over it).
COPY --from=build --chown=65532:65532 /out/var/lib/ /var/lib/
# The annotated example, so the image runs as is; Kubernetes mounts a ConfigMap over it.
COPY config/fencegate.yaml /etc/fencegate/fencegate.yaml
# 7440 fence proxy, 7441 admin (metrics, probes), 7442 lease API, 7443 egress.
EXPOSE 7440 7441 7442 7443
# distroless "nonroot", numeric so the kubelet can verify runAsNonRoot.
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/fencegate"]
CMD ["run", "--config", "/etc/fencegate/fencegate.yaml"]
