# Multi-stage build of the registrar. The build command is the one CI runs (tests/run):
#   cargo build --release --locked --bin spiffe-registrar
# protox compiles the protos in-process, so no protoc is needed.
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY proto ./proto
COPY src ./src
COPY tests ./tests
COPY manifests ./manifests
RUN cargo build --release --locked --bin spiffe-registrar

# Distroless, no shell, non-root (65532 = nonroot).
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/spiffe-registrar /usr/local/bin/spiffe-registrar
USER 65532:65532
EXPOSE 8443 8080
ENTRYPOINT ["/usr/local/bin/spiffe-registrar"]
CMD ["run"]
