// The binary's unsafe code: the allocator option in `return_freed_memory_promptly` and the
// counting allocator wrapper `Counted` (each `#[allow(unsafe_code)]`; Cargo.toml denies it).

use clap::{Parser, Subcommand};
use spiffe_registrar::config::{RunArgs, parse_duration};
use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

/// mimalloc, not glibc's malloc: with glibc, memory freed by one tokio worker stays in that
/// thread's arena, and at 10,000 Deployments the process held 87 MB of heap for 26 MB in use.
/// mimalloc returns freed pages to the OS (see `return_freed_memory_promptly`), so RSS follows
/// what is live (the README's memory sizing).
#[cfg(not(feature = "heap-profile"))]
#[global_allocator]
static ALLOCATOR: Counted<mimalloc::MiMalloc> = Counted(mimalloc::MiMalloc);

/// Counts the bytes in use for the `heap_live_bytes` gauge (`telemetry::heap`), so an
/// operator can tell data we hold from pages the allocator keeps.
#[cfg(not(feature = "heap-profile"))]
struct Counted<A>(A);

// SAFETY: every call is forwarded unchanged to the inner allocator; the counting has no
// effect on the memory handed out.
#[cfg(not(feature = "heap-profile"))]
#[allow(unsafe_code)]
unsafe impl<A: std::alloc::GlobalAlloc> std::alloc::GlobalAlloc for Counted<A> {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        // SAFETY: the caller's contract is passed on.
        let pointer = unsafe { self.0.alloc(layout) };
        if !pointer.is_null() {
            spiffe_registrar::telemetry::heap::allocated(layout.size());
        }
        pointer
    }

    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        // SAFETY: as above.
        let pointer = unsafe { self.0.alloc_zeroed(layout) };
        if !pointer.is_null() {
            spiffe_registrar::telemetry::heap::allocated(layout.size());
        }
        pointer
    }

    unsafe fn dealloc(&self, pointer: *mut u8, layout: std::alloc::Layout) {
        spiffe_registrar::telemetry::heap::freed(layout.size());
        // SAFETY: as above.
        unsafe { self.0.dealloc(pointer, layout) }
    }

    unsafe fn realloc(
        &self,
        pointer: *mut u8,
        layout: std::alloc::Layout,
        new_size: usize,
    ) -> *mut u8 {
        // SAFETY: as above.
        let moved = unsafe { self.0.realloc(pointer, layout, new_size) };
        if !moved.is_null() {
            spiffe_registrar::telemetry::heap::freed(layout.size());
            spiffe_registrar::telemetry::heap::allocated(new_size);
        }
        moved
    }
}

/// `--features heap-profile`: every allocation is attributed to its call site, and on a clean
/// exit the profile (peak and final heap, by call site) is written to `$DHAT_FILE`
/// (default `dhat-heap.json`), readable with dhat's viewer. For finding what grows with the
/// number of Deployments; far too slow for production.
#[cfg(feature = "heap-profile")]
#[global_allocator]
static ALLOCATOR: dhat::Alloc = dhat::Alloc;

/// mimalloc's `purge_delay` option (milliseconds; its index in mimalloc 3's option table,
/// checked by the test below against the option's unique default of 1000).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// By default mimalloc returns freed pages only after a delay, and only when the same heap
/// allocates again: a worker that goes idle after a burst (a sync, the initial list) keeps
/// its pages. At 1,000 Deployments that doubled steady RSS (45.6 vs 25.5 MiB). Purging at once
/// costs an madvise per freed page, nothing measurable here.
#[allow(unsafe_code)]
fn return_freed_memory_promptly() {
    // SAFETY: sets a plain integer option; mimalloc reads options atomically and allows
    // changing them at any time.
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, 0) };
}

/// Transparent huge pages off for this process. mimalloc asks for them (`MADV_HUGEPAGE` on its
/// arenas), and a 2 MiB page stays resident while any object on it is live: in the scale
/// benchmark at 10,000 Deployments, 39 of 78 MiB of RSS were huge pages over a 16 MiB heap,
/// and the gap grew with every burst. Best effort: a kernel without the call keeps its
/// default.
fn no_transparent_huge_pages() {
    if let Err(error) = nix::sys::prctl::set_thp_disable(true) {
        eprintln!("could not turn transparent huge pages off ({error}); RSS may run higher");
    }
}

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
    /// Take the registrar out of the cluster: delete the webhook configuration, then remove
    /// our finalizer and annotations from every Deployment; SPIRE entries only with
    /// --delete-entries. Scale the registrar to 0 first.
    Uninstall(Box<spiffe_registrar::uninstall::UninstallArgs>),
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
    #[cfg(feature = "heap-profile")]
    let _profiler = dhat::Profiler::builder()
        .file_name(std::env::var_os("DHAT_FILE").unwrap_or_else(|| "dhat-heap.json".into()))
        .build();
    no_transparent_huge_pages();
    return_freed_memory_promptly();
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
        Command::Uninstall(args) => {
            spiffe_registrar::telemetry::init_logging(false);
            let runtime = tokio::runtime::Runtime::new()?;
            print!(
                "{}",
                runtime.block_on(spiffe_registrar::uninstall::uninstall(*args))?
            );
        }
        Command::Run(args) => {
            spiffe_registrar::telemetry::init_logging(args.log_json);
            let settings = args.validate()?;
            tracing::info!(version = spiffe_registrar::version::VERSION, "starting");
            let runtime = tokio::runtime::Runtime::new()?;
            let outcome = runtime.block_on(async move {
                let shutdown = tokio_util::sync::CancellationToken::new();
                tokio::spawn(spiffe_registrar::run::stop_on_signal(shutdown.clone()));
                spiffe_registrar::run::run(settings, shutdown).await
            });
            // Work still on the blocking pool (a recompute of desired state) must not hold
            // the exit: SIGTERM is answered within seconds.
            runtime.shutdown_timeout(std::time::Duration::from_millis(500));
            outcome?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    #[allow(unsafe_code)]
    fn the_purge_delay_option_is_the_one_we_set() {
        // SAFETY: reads a plain integer option.
        let default = unsafe { libmimalloc_sys::mi_option_get(super::MI_OPTION_PURGE_DELAY) };
        assert_eq!(
            default,
            1000,
            "index {} is not purge_delay in this mimalloc version",
            super::MI_OPTION_PURGE_DELAY
        );
        super::return_freed_memory_promptly();
        // SAFETY: as above.
        let set = unsafe { libmimalloc_sys::mi_option_get(super::MI_OPTION_PURGE_DELAY) };
        assert_eq!(set, 0);
    }

    #[test]
    fn transparent_huge_pages_are_off_for_the_process() {
        super::no_transparent_huge_pages();
        assert_eq!(nix::sys::prctl::get_thp_disable(), Ok(true));
    }
}
