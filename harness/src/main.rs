//! `chaos`: the ADR-022 chaos-verification harness CLI (CONTRACT § chaos).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Run ADR-022 chaos scenarios against real PostgreSQL and RabbitMQ and check the invariants.
#[derive(Parser)]
#[command(name = "chaos", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run scenario files or folders (default: scenarios/).
    Run {
        paths: Vec<PathBuf>,
    },
    /// List the scenarios found.
    List {
        paths: Vec<PathBuf>,
    },
}

fn scenario_files(paths: &[PathBuf]) -> std::io::Result<Vec<PathBuf>> {
    let roots = if paths.is_empty() { vec![PathBuf::from("scenarios")] } else { paths.to_vec() };
    let mut out = Vec::new();
    for root in roots {
        if root.is_dir() {
            for entry in std::fs::read_dir(&root)? {
                let p = entry?.path();
                if p.extension().is_some_and(|e| e == "toml") {
                    out.push(p);
                }
            }
        } else {
            out.push(root);
        }
    }
    out.sort();
    Ok(out)
}

fn main() -> ExitCode {
    // `chaos craig-node …` runs a fleet node: the harness's replicas are this binary.
    let mut args = std::env::args_os();
    if std::env::args_os().nth(1).is_some_and(|a| a == "craig-node") {
        let _self = args.next();
        return craig_fleet::cli::run(args);
    }
    let cli = Cli::parse();
    let (Command::Run { paths } | Command::List { paths }) = &cli.command;
    match scenario_files(paths) {
        Ok(files) if files.is_empty() => {
            println!("chaos: no scenarios yet");
            ExitCode::SUCCESS
        }
        Ok(files) => {
            for f in files {
                println!("{}", f.display());
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("chaos: {e}");
            ExitCode::from(2)
        }
    }
}
