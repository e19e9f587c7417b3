//! How we reach the SPIRE server:
//! - `Unix`: its admin socket, shared with us as a sidecar (no TLS; the socket's file mode is
//!   the access control), as spire-controller-manager is deployed;
//! - `Tcp`: its TCP port over mTLS. Our X509-SVID comes from the agent's Workload API through a
//!   rotating `X509Source`; the server is authorized by its SPIFFE ID, not by a hostname (its
//!   SVID has no DNS SANs). Its SVID must belong to an admin entry or `admin_ids`.
//!
//! Both channels connect lazily and reconnect by themselves after a server restart.

use super::api::SpireError;
use hyper_util::rt::TokioIo;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tonic::transport::{Channel, Endpoint, Uri};
use tower::service_fn;

#[derive(Clone, Debug)]
pub enum SpireEndpoint {
    Unix {
        socket: PathBuf,
    },
    Tcp {
        /// `host:port`
        address: String,
        /// SPIFFE ID the server must present, e.g. `spiffe://example.org/spire/server`.
        server_id: String,
        /// The agent's Workload API, e.g. `unix:///run/spire/agent-sockets/api.sock`.
        workload_api: String,
    },
}

/// Keeps what the channel needs alive (the rotating SVID source for mTLS).
pub struct Connection {
    pub channel: Channel,
    source: Option<spiffe::X509Source>,
}

impl Connection {
    /// Stops the SVID source's background updates.
    pub async fn shutdown(&self) {
        if let Some(source) = &self.source {
            source.shutdown().await;
        }
    }
}

fn endpoint() -> Endpoint {
    // The URI is a placeholder: the connector decides where to dial. Plain http because TLS,
    // when used, is done by our connector (with SPIFFE authorization).
    Endpoint::from_static("http://spire-server.invalid")
        .connect_timeout(Duration::from_secs(5))
        .http2_keep_alive_interval(Duration::from_secs(30))
        .keep_alive_timeout(Duration::from_secs(10))
        .keep_alive_while_idle(true)
}

pub async fn connect(
    target: &SpireEndpoint,
    svid_timeout: Duration,
) -> Result<Connection, SpireError> {
    match target {
        SpireEndpoint::Unix { socket } => {
            let socket = socket.clone();
            let channel = endpoint().connect_with_connector_lazy(service_fn(move |_: Uri| {
                let socket = socket.clone();
                async move {
                    Ok::<_, std::io::Error>(TokioIo::new(
                        tokio::net::UnixStream::connect(socket).await?,
                    ))
                }
            }));
            Ok(Connection {
                channel,
                source: None,
            })
        }
        SpireEndpoint::Tcp {
            address,
            server_id,
            workload_api,
        } => {
            let source = spiffe::X509Source::builder()
                .endpoint(workload_api)
                .initial_sync_timeout(svid_timeout)
                .build()
                .await
                .map_err(|e| {
                    SpireError::Connect(format!(
                        "no X509-SVID from the Workload API at {workload_api}: {e}"
                    ))
                })?;
            // Default: the SPIRE server of our own trust domain.
            let server_id = if server_id.is_empty() {
                let svid = source
                    .svid()
                    .map_err(|e| SpireError::Connect(format!("no X509-SVID: {e}")))?;
                format!("spiffe://{}/spire/server", svid.spiffe_id().trust_domain())
            } else {
                server_id.clone()
            };
            let mut tls = spiffe_rustls::mtls_client(source.clone())
                .authorize(
                    spiffe_rustls::authorizer::exact([server_id.as_str()]).map_err(|e| {
                        SpireError::Connect(format!("invalid --spire-server-id {server_id:?}: {e}"))
                    })?,
                )
                .build()
                .map_err(|e| SpireError::Connect(format!("mTLS client config: {e}")))?;
            // SPIRE's TCP listener speaks gRPC only over ALPN h2.
            tls.alpn_protocols = vec![b"h2".to_vec()];
            let connector = tokio_rustls::TlsConnector::from(Arc::new(tls));
            let address = address.clone();
            let channel = endpoint().connect_with_connector_lazy(service_fn(move |_: Uri| {
                let (connector, address) = (connector.clone(), address.clone());
                async move {
                    let tcp = tokio::net::TcpStream::connect(&address).await?;
                    tcp.set_nodelay(true)?;
                    // rustls wants a name; the SPIFFE authorizer, not this name, decides trust.
                    let name = rustls::pki_types::ServerName::try_from("spire-server")
                        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
                    let stream = connector.connect(name, tcp).await?;
                    Ok::<_, std::io::Error>(TokioIo::new(stream))
                }
            }));
            Ok(Connection {
                channel,
                source: Some(source),
            })
        }
    }
}
