//! The troupe binary, built inside the tests crate so process-level tests can start nodes.

fn main() -> std::process::ExitCode {
    troupe::cli::main()
}
