// The binary's unsafe code: jemalloc's compiled-in settings (`JEMALLOC_SETTINGS`) and the
// counting allocator wrapper `Counted` (each `#[allow(unsafe_code)]`; Cargo.toml denies it).

use clap::{Parser, Subcommand};
use spiffe_registrar::config::{RunArgs, parse_duration};
use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

/// jemalloc, with `JEMALLOC_SETTINGS`. The allocator decides how much of the RSS is data:
/// - glibc's malloc kept memory freed by one tokio worker in that thread's arena (87 MB held
///   for 26 MB in use at 10,000 Deployments);
/// - mimalloc (sessions 3 to 6) kept partly used pages of every size class per thread: at
///   10,000 Deployments 25 MiB of anonymous memory for a 12.5 MiB heap at rest, and a peak of
///   46.3 MiB RSS;
/// - jemalloc as set below: 32.3 MiB at rest and a 39.2 MiB peak, same build, same benchmark.
#[cfg(not(feature = "heap-profile"))]
#[global_allocator]
static ALLOCATOR: Counted<tikv_jemallocator::Jemalloc> = Counted(tikv_jemallocator::Jemalloc);

/// A C string jemalloc reads at its start (`malloc_conf`, which the library declares weak so a
/// program can define it).
#[repr(transparent)]
struct JemallocSettings(*const std::ffi::c_char);

// SAFETY: points at a string literal, immutable for the life of the process.
#[allow(unsafe_code)]
unsafe impl Sync for JemallocSettings {}

/// jemalloc's settings; `_RJEM_MALLOC_CONF` in the environment still overrides each one.
/// - `narenas:2`: an arena per core of the requested 2, not jemalloc's default of 4 per CPU of
///   the node; each arena keeps its own partly used pages.
/// - `background_thread:true`: freed pages are returned by jemalloc's own thread, also after
///   a burst on a worker that then goes idle.
/// - `dirty_decay_ms`, `muzzy_decay_ms`: freed pages go back to the OS within a quarter of a
///   second, and never linger as lazily freed pages (they count in RSS until reclaimed).
///   Returning them at once (0) cost 10% more CPU per status update.
#[cfg(not(feature = "heap-profile"))]
#[allow(unsafe_code)]
#[unsafe(export_name = "_rjem_malloc_conf")]
static JEMALLOC_SETTINGS: JemallocSettings = JemallocSettings(
    c"narenas:2,background_thread:true,dirty_decay_ms:250,muzzy_decay_ms:0".as_ptr(),
);

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

/// Transparent huge pages off for this process: a 2 MiB page stays resident while any object
/// on it is live. With mimalloc, which asks for them on its arenas, 39 of 78 MiB of RSS were
/// huge pages over a 16 MiB heap in the scale benchmark at 10,000 Deployments; kept off
/// whatever the allocator, since a kernel set to `always` would do the same to jemalloc's.
/// Best effort: a kernel without the call keeps its default.
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
    /// our finalizer and annotations from every workload; SPIRE entries only with
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
            let runtime = serving_runtime()?;
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

/// The runtime `run` serves on: one worker thread unless `TOKIO_WORKER_THREADS` says otherwise.
/// Its async work is I/O (watches, the webhook, SPIRE and Kubernetes calls); the CPU-heavy part,
/// deriving desired state, runs on the blocking pool. Two workers on two cores spent their
/// time handing tasks to each other: at 10,000 Deployments one worker converged in 3.4 CPU s
/// instead of 4.6, and read each status write of kube-controller-manager for ~0.07 ms of CPU
/// instead of ~0.09.
fn serving_runtime() -> std::io::Result<tokio::runtime::Runtime> {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if std::env::var_os("TOKIO_WORKER_THREADS").is_none() {
        builder.worker_threads(1);
    }
    builder.enable_all().build()
}

#[cfg(test)]
mod tests {
    /// The compiled-in settings are the ones jemalloc runs with (a misspelt key is only
    /// warned about on stderr, and the symbol's name depends on the crate's prefix). Fails
    /// under a `_RJEM_MALLOC_CONF` that overrides them, as it should: the test is about what
    /// ships.
    #[test]
    #[allow(unsafe_code)]
    fn jemalloc_runs_with_our_settings() {
        use tikv_jemalloc_ctl::raw;
        // SAFETY: each name is a jemalloc option of the type read.
        let (narenas, background, dirty, muzzy) = unsafe {
            (
                raw::read::<u32>(b"opt.narenas\0"),
                raw::read::<bool>(b"opt.background_thread\0"),
                raw::read::<isize>(b"opt.dirty_decay_ms\0"),
                raw::read::<isize>(b"opt.muzzy_decay_ms\0"),
            )
        };
        assert_eq!(
            (narenas, background, dirty, muzzy),
            (Ok(2), Ok(true), Ok(250), Ok(0))
        );
    }

    #[test]
    fn transparent_huge_pages_are_off_for_the_process() {
        super::no_transparent_huge_pages();
        assert_eq!(nix::sys::prctl::get_thp_disable(), Ok(true));
    }
}
