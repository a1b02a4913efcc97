//! troupe's transport: QUIC endpoints with mutual TLS, framed rkyv messages, tensor codecs,
//! content-addressed blobs, and the `Link` seam with a seeded in-memory implementation.
