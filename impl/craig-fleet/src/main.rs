//! `craig-node`: run one fleet service, or apply its migrations (see `craig_fleet::cli`).

fn main() -> std::process::ExitCode {
    craig_fleet::cli::run(std::env::args_os())
}
