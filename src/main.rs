use std::process::ExitCode;

fn main() -> ExitCode {
    fencegate::cli::main()
}
