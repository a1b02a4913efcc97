//! The `troupe` command line.

fn main() -> std::process::ExitCode {
    troupe_cli::main()
}
