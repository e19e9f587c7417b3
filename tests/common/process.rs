//! A child process in its own process group, with its output in a log file.

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use std::fs::File;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct ManagedProcess {
    pub name: String,
    child: Option<Child>,
    pub log_path: PathBuf,
}

impl ManagedProcess {
    /// Starts `command` as the leader of a new process group, output to `<log_dir>/<name>.log`.
    pub fn spawn(name: &str, mut command: Command, log_dir: &Path) -> Self {
        let log_path = log_dir.join(format!("{name}.log"));
        let log = File::create(&log_path).expect("the log file must be creatable");
        let child = command
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log handle must clone"))
            .stderr(log)
            .process_group(0)
            .spawn()
            .unwrap_or_else(|err| panic!("starting {name} ({command:?}) failed: {err}"));
        Self {
            name: name.to_string(),
            child: Some(child),
            log_path,
        }
    }

    /// The process group id (= pid of the leader).
    pub fn pgid(&self) -> i32 {
        self.child.as_ref().map(|c| c.id() as i32).unwrap_or(0)
    }

    /// Panics with the log's tail if the process has already exited.
    pub fn assert_running(&mut self) {
        if let Some(child) = self.child.as_mut()
            && let Ok(Some(status)) = child.try_wait()
        {
            panic!(
                "{} exited early with {status}:\n{}",
                self.name,
                self.log_tail(60)
            );
        }
    }

    /// Panics with the log's tail if the process has exited, through a shared reference (a
    /// waiting loop that only holds the stack behind an `Arc`): an unreaped child shows as a
    /// zombie in `/proc`.
    pub fn assert_alive(&self) {
        let pid = self.pgid();
        let state = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|stat| {
                // The state follows the command name, which is in parentheses.
                let after_name = stat.rsplit_once(')')?.1;
                after_name.split_whitespace().next().map(str::to_owned)
            });
        if pid == 0 || matches!(state.as_deref(), None | Some("Z" | "X")) {
            panic!("{} has exited:\n{}", self.name, self.log_tail(60));
        }
    }

    /// SIGTERM to the whole group, SIGKILL after `grace`; reaps the leader.
    pub fn stop(&mut self, grace: Duration) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let group = Pid::from_raw(child.id() as i32);
        let _ = killpg(group, Signal::SIGTERM);
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if matches!(child.try_wait(), Ok(Some(_))) {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        // Members of the group may outlive the leader; the group kill covers them too.
        let _ = killpg(group, Signal::SIGKILL);
        let _ = child.wait();
    }

    /// SIGTERM to the leader only, as the kubelet sends it; waits up to `within` for it to
    /// exit. Returns how long it took and its status (`None`: still running, then killed).
    pub fn terminate(&mut self, within: Duration) -> (Duration, Option<std::process::ExitStatus>) {
        let Some(child) = self.child.as_mut() else {
            return (Duration::ZERO, None);
        };
        let _ = nix::sys::signal::kill(Pid::from_raw(child.id() as i32), Signal::SIGTERM);
        let started = Instant::now();
        let status = self.wait_exit(within);
        let took = started.elapsed();
        self.stop(Duration::ZERO);
        (took, status)
    }

    /// Waits up to `within` for the process to exit by itself; its status if it did.
    pub fn wait_exit(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        let child = self.child.as_mut()?;
        let deadline = Instant::now() + within;
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Kills the group at once (SIGKILL), as a crash would.
    pub fn kill(&mut self) {
        self.stop(Duration::ZERO);
    }

    pub fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log_path).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }
}

impl Drop for ManagedProcess {
    fn drop(&mut self) {
        self.stop(Duration::from_secs(5));
    }
}

/// True while any process of group `pgid` exists.
pub fn group_alive(pgid: i32) -> bool {
    killpg(Pid::from_raw(pgid), None).is_ok()
}

/// Polls `ready` every 100 ms until it returns true, panicking after `timeout` with `what`.
pub fn wait_until(what: &str, timeout: Duration, mut ready: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if ready() {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("timed out after {timeout:?} waiting for {what}");
}

/// Runs a command to completion; returns (success, stdout, stderr).
pub fn run(command: &mut Command) -> (bool, String, String) {
    let output = command
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|err| panic!("running {command:?} failed: {err}"));
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// A minimal HTTP/1.0 GET on loopback; true on a 200 answer.
pub fn http_get_ok(port: u16, path: &str) -> bool {
    http_get(port, path).is_some()
}

/// A minimal HTTP/1.0 GET on loopback: status code and body of any answer.
pub fn http_get_status(port: u16, path: &str) -> Option<(u16, String)> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    write!(stream, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
    let mut response = String::new();
    let _ = stream.read_to_string(&mut response);
    let status = response.split_whitespace().nth(1)?.parse().ok()?;
    let body = response.split_once("\r\n\r\n").map(|(_, b)| b.to_string());
    Some((status, body.unwrap_or_default()))
}

/// A minimal HTTP/1.0 GET on loopback; the body of a 200 answer.
pub fn http_get(port: u16, path: &str) -> Option<String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    write!(stream, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
    let mut response = String::new();
    let _ = stream.read_to_string(&mut response);
    let ok = response.starts_with("HTTP/1.0 200") || response.starts_with("HTTP/1.1 200");
    ok.then(|| {
        response
            .split_once("\r\n\r\n")
            .map(|(_, body)| body.to_string())
            .unwrap_or_default()
    })
}
