//! The troupe CLI built inside the test package, so process-level tests can start nodes.

fn main() -> std::process::ExitCode {
    troupe::cli::main()
}
