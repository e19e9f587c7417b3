#![forbid(unsafe_code)]

use clap::{Parser, Subcommand};

/// Gives every in-scope Kubernetes Deployment a SPIFFE identity, registered in SPIRE.
#[derive(Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the admission webhook and the controller.
    Run,
    /// Print the version.
    Version,
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Version => println!("{}", spiffe_registrar::version::describe()),
        Command::Run => anyhow::bail!("`run` is not implemented yet"),
    }
    Ok(())
}
