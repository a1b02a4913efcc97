//! Helpers for troupe's whole-cluster tests.

pub mod pipeline;
