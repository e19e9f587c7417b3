//! A byte proxy on loopback (TCP) or a Unix socket, which a test can cut and restore, or
//! stall: a partition between one registrar and the apiserver, or between one registrar and
//! its SPIRE server, while everything else keeps talking. A cut resets connections (a dead
//! peer's kernel); a stall keeps them open and silent (a network path that drops packets).

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::task::AbortHandle;

pub struct Proxy {
    cut: Arc<AtomicBool>,
    stalled: tokio::sync::watch::Sender<bool>,
    open: Arc<Mutex<Vec<AbortHandle>>>,
    accept: AbortHandle,
    /// Where clients connect: `127.0.0.1:<port>` or a socket path.
    pub listen: String,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.sever();
    }
}

impl Proxy {
    /// Forwards a fresh loopback port to `target` (host:port).
    pub async fn tcp(target: String) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a proxy port");
        let listen = listener.local_addr().expect("addr").to_string();
        let listener = Arc::new(listener);
        Self::run(listen, move || {
            let (target, listener) = (target.clone(), listener.clone());
            async move {
                let (client, _) = listener.accept().await.ok()?;
                let upstream = tokio::net::TcpStream::connect(target).await;
                Some((client, upstream.ok()))
            }
        })
    }

    /// Forwards the Unix socket `listen` to the Unix socket `target`.
    pub async fn unix(listen: PathBuf, target: PathBuf) -> Self {
        let _ = std::fs::remove_file(&listen);
        let listener = tokio::net::UnixListener::bind(&listen).expect("bind a proxy socket");
        let shown = listen.display().to_string();
        let listener = Arc::new(listener);
        Self::run(shown, move || {
            let (target, listener) = (target.clone(), listener.clone());
            async move {
                let (client, _) = listener.accept().await.ok()?;
                let upstream = tokio::net::UnixStream::connect(target).await;
                Some((client, upstream.ok()))
            }
        })
    }

    fn run<S, F, Fut>(listen: String, accept: F) -> Self
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Option<(S, Option<S>)>> + Send,
    {
        let cut = Arc::new(AtomicBool::new(false));
        let (stalled, stall) = tokio::sync::watch::channel(false);
        let open: Arc<Mutex<Vec<AbortHandle>>> = Arc::default();
        let task = tokio::spawn({
            let (cut, open) = (cut.clone(), open.clone());
            async move {
                loop {
                    let Some((mut client, upstream)) = accept().await else {
                        continue;
                    };
                    // Cut: the connection is accepted and dropped at once (a partition that
                    // resets, which is what a client sees from a dead peer's kernel).
                    let Some(mut upstream) = upstream.filter(|_| !cut.load(Ordering::SeqCst))
                    else {
                        continue;
                    };
                    let mut stall = stall.clone();
                    let copy = tokio::spawn(async move {
                        let stalled = tokio::select! {
                            _ = tokio::io::copy_bidirectional(&mut client, &mut upstream) => false,
                            _ = stall.wait_for(|stalled| *stalled) => true,
                        };
                        if stalled {
                            // Both ends stay open, and nothing more is read or written.
                            std::future::pending::<()>().await;
                        }
                    });
                    open.lock().expect("lock").push(copy.abort_handle());
                }
            }
        });
        Self {
            cut,
            stalled,
            open,
            accept: task.abort_handle(),
            listen,
        }
    }

    /// Drops every open connection and refuses new ones until `restore`.
    pub fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
        self.sever();
    }

    /// Keeps every connection, open and new, open and silent: nothing is forwarded.
    pub fn stall(&self) {
        self.stalled.send_replace(true);
    }

    pub fn restore(&self) {
        self.cut.store(false, Ordering::SeqCst);
    }

    fn sever(&self) {
        for connection in self.open.lock().expect("lock").drain(..) {
            connection.abort();
        }
    }
}
