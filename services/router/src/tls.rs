//! TLS of the router's public endpoints (gRPC and HTTP, from one certificate and key) and of
//! its calls to workers (a CA to verify them by, and an optional client identity for mTLS).
//! Everything is rustls (tonic's `tls-ring`, tokio-rustls on the HTTP front).

use std::sync::Arc;

use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

/// A server certificate chain and its key, PEM.
#[derive(Clone)]
pub struct ServerTls {
    cert_pem: Vec<u8>,
    key_pem: Vec<u8>,
    /// Clients must present a certificate signed by this CA (mTLS).
    client_ca_pem: Option<Vec<u8>>,
    http: Arc<rustls::ServerConfig>,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ServerTls(mtls: {})", self.client_ca_pem.is_some())
    }
}

/// Why certificates and keys do not make a TLS configuration: the error of this crate.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("the certificate file holds no certificate")]
    NoCertificate,
    #[error("{what}: {source}")]
    Invalid {
        what: &'static str,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

impl TlsError {
    fn new(what: &'static str, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self::Invalid {
            what,
            source: Box::new(source),
        }
    }
}

impl ServerTls {
    /// Checks the PEMs (a chain, a private key that rustls can use) and prepares both fronts.
    pub fn from_pem(
        cert_pem: Vec<u8>,
        key_pem: Vec<u8>,
        client_ca_pem: Option<Vec<u8>>,
    ) -> Result<Self, TlsError> {
        let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&cert_pem)
            .collect::<Result<_, _>>()
            .map_err(|e| TlsError::new("the certificate file is not PEM certificates", e))?;
        if chain.is_empty() {
            return Err(TlsError::NoCertificate);
        }
        let key = PrivateKeyDer::from_pem_slice(&key_pem)
            .map_err(|e| TlsError::new("the key file holds no PEM private key", e))?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::new("no protocol version", e))?;
        let builder = match &client_ca_pem {
            None => builder.with_no_client_auth(),
            Some(ca) => {
                let mut roots = rustls::RootCertStore::empty();
                for c in CertificateDer::pem_slice_iter(ca) {
                    let c = c.map_err(|e| TlsError::new("the client CA file is not PEM", e))?;
                    roots
                        .add(c)
                        .map_err(|e| TlsError::new("bad client CA certificate", e))?;
                }
                let verifier = rustls::server::WebPkiClientVerifier::builder(Arc::new(roots))
                    .build()
                    .map_err(|e| TlsError::new("client CA", e))?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let mut http = builder
            .with_single_cert(chain, key)
            .map_err(|e| TlsError::new("the certificate and key do not make a TLS identity", e))?;
        http.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(Self {
            cert_pem,
            key_pem,
            client_ca_pem,
            http: Arc::new(http),
        })
    }

    /// For tonic's server.
    pub fn grpc(&self) -> ServerTlsConfig {
        let mut c =
            ServerTlsConfig::new().identity(Identity::from_pem(&self.cert_pem, &self.key_pem));
        if let Some(ca) = &self.client_ca_pem {
            c = c.client_ca_root(Certificate::from_pem(ca));
        }
        c
    }

    /// For the HTTP front's acceptor.
    pub fn http(&self) -> Arc<rustls::ServerConfig> {
        self.http.clone()
    }
}

/// How the router reaches workers over TLS: the CA it verifies them by, and its own identity
/// when workers require client certificates.
#[derive(Clone)]
pub struct WorkerTls {
    ca_pem: Vec<u8>,
    identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for WorkerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "WorkerTls(client identity: {})", self.identity.is_some())
    }
}

impl WorkerTls {
    pub fn new(ca_pem: Vec<u8>, identity: Option<(Vec<u8>, Vec<u8>)>) -> Self {
        Self { ca_pem, identity }
    }

    /// tonic's client configuration for a worker reached as `host` (the name its certificate
    /// must carry: the configured target's host, a DNS name or an IP address).
    pub fn client(&self, host: &str) -> ClientTlsConfig {
        let mut c = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&self.ca_pem))
            .domain_name(host.trim_start_matches('[').trim_end_matches(']'));
        if let Some((cert, key)) = &self.identity {
            c = c.identity(Identity::from_pem(cert, key));
        }
        c
    }
}
