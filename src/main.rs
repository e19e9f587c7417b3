#![forbid(unsafe_code)]

use clap::{Parser, Subcommand};
use spiffe_registrar::config::{RunArgs, parse_duration};
use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

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
    Run(Box<RunArgs>),
    /// Print the creates, updates and deletes a sync would do now; changes nothing.
    Plan(Box<RunArgs>),
    /// Print the SpiffeRegistration CRD as YAML.
    Crd,
    /// Webhook certificates for running outside a cluster.
    #[command(subcommand)]
    Certs(CertsCommand),
    /// Print the version.
    Version,
}

#[derive(Subcommand)]
enum CertsCommand {
    /// Write a CA (ca.crt, ca.key) and a serving certificate (tls.crt, tls.key) it signs.
    Generate {
        /// DNS name for the serving certificate (repeatable).
        #[arg(long = "dns-name")]
        dns_names: Vec<String>,
        /// IP address for the serving certificate (repeatable).
        #[arg(long = "ip")]
        ips: Vec<IpAddr>,
        /// Output directory.
        #[arg(long, default_value = "webhook-certs")]
        out: PathBuf,
        /// Serving certificate lifetime (the CA gets four times as long).
        #[arg(long, default_value = "720h", value_parser = parse_duration)]
        validity: Duration,
    },
}

fn main() -> anyhow::Result<()> {
    rustls::crypto::ring::default_provider()
        .install_default()
        .map_err(|_| anyhow::anyhow!("a rustls crypto provider was already installed"))?;
    match Cli::parse().command {
        Command::Version => println!("{}", spiffe_registrar::version::describe()),
        Command::Crd => print!("{}", spiffe_registrar::policy::crd::yaml()?),
        Command::Certs(CertsCommand::Generate {
            dns_names,
            ips,
            out,
            validity,
        }) => {
            anyhow::ensure!(
                !dns_names.is_empty() || !ips.is_empty(),
                "give at least one --dns-name or --ip"
            );
            spiffe_registrar::certs::write_files(&out, &dns_names, &ips, validity)?;
            println!(
                "wrote ca.crt, ca.key, tls.crt, tls.key to {}",
                out.display()
            );
        }
        Command::Plan(args) => {
            let settings = args.validate()?;
            let runtime = tokio::runtime::Runtime::new()?;
            print!(
                "{}",
                runtime.block_on(spiffe_registrar::run::plan(settings))?
            );
        }
        Command::Run(args) => {
            spiffe_registrar::telemetry::init_logging(args.log_json);
            let settings = args.validate()?;
            tracing::info!(version = spiffe_registrar::version::VERSION, "starting");
            let runtime = tokio::runtime::Runtime::new()?;
            runtime.block_on(async move {
                let shutdown = tokio_util::sync::CancellationToken::new();
                tokio::spawn(spiffe_registrar::run::stop_on_signal(shutdown.clone()));
                spiffe_registrar::run::run(settings, shutdown).await
            })?;
        }
    }
    Ok(())
}
