//! A byte proxy on loopback (TCP) or a Unix socket, which a test can cut and restore: a
//! partition between one registrar and the apiserver, or between one registrar and its SPIRE
//! server, while everything else keeps talking.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::task::AbortHandle;

pub struct Proxy {
    cut: Arc<AtomicBool>,
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
                    let copy = tokio::spawn(async move {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
                    });
                    open.lock().expect("lock").push(copy.abort_handle());
                }
            }
        });
        Self {
            cut,
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

    pub fn restore(&self) {
        self.cut.store(false, Ordering::SeqCst);
    }

    fn sever(&self) {
        for connection in self.open.lock().expect("lock").drain(..) {
            connection.abort();
        }
    }
}
