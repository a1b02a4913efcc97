//! The `troupe` CLI built inside the tests package, so whole-cluster tests can start real node
//! processes (`env!("CARGO_BIN_EXE_troupe-node")`).

fn main() -> std::process::ExitCode {
    troupe_cli::main()
}
