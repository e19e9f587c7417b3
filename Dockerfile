# Placeholder until the packaging work: the release build is the one CI runs.
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked --bin spiffe-registrar

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/spiffe-registrar /usr/local/bin/spiffe-registrar
USER 65532
ENTRYPOINT ["/usr/local/bin/spiffe-registrar"]
