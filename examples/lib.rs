//! Embedding examples for troupe (see `examples/*.rs`).
