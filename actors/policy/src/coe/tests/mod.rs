//! Cross-module tests of the CoE policy: golden decision traces, properties, and scale.

mod golden;
mod props;
mod scale;
