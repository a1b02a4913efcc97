//! Examples for troupe, each a program a user can copy (`cargo run -p troupe-examples --bin NAME`):
//!
//! - `embed`: one node in-process, a typed actor called through a local handle;
//! - `remote_counter`: a counter on one node process called by name from others, roles checked
//!   per message;
//! - `own_expert`: your own ONNX model served as an actor and called from another node process;
//! - `failover`: a child supervised across nodes, restarted on another worker when its node is
//!   killed, while a client's calls by name carry on.
//!
//! With no arguments each multi-node example runs its whole demo, starting itself as the node
//! processes; `tests/examples.rs` runs every one.
