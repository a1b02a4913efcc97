//! Helpers for troupe's whole-cluster tests.
