//! TLS on real processes, with certificates made in the test (rcgen): the router's public gRPC
//! and HTTP endpoints over TLS, verified by clients that trust only the test CA; mTLS between
//! router and worker (the worker refuses a router without a client certificate it trusts).

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};
use wavefront_proto::v1 as pb;
use wavefront_proto::v1::generation_client::GenerationClient;

use crate::harness::{fixture, spawn, spawn_router};
use crate::metrics::free_port;

/// A CA, and PEM files it signed, in a directory of their own.
struct Pki {
    dir: PathBuf,
    ca_pem: String,
}

impl Pki {
    fn new(name: &str) -> (Self, CertifiedIssuer<'static, KeyPair>) {
        let dir = std::env::temp_dir().join(format!("wavefront-tls-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
        let ca_pem = ca.pem();
        std::fs::write(dir.join("ca.pem"), &ca_pem).unwrap();
        (Self { dir, ca_pem }, ca)
    }

    /// A certificate for `names` (DNS names or IP addresses) signed by `ca`: (cert, key) paths.
    fn issue(
        &self,
        ca: &CertifiedIssuer<'static, KeyPair>,
        file: &str,
        names: &[&str],
    ) -> (PathBuf, PathBuf) {
        let key = KeyPair::generate().unwrap();
        let params =
            CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>())
                .unwrap();
        let cert = params.signed_by(&key, ca).unwrap();
        let (c, k) = (
            self.dir.join(format!("{file}.pem")),
            self.dir.join(format!("{file}.key")),
        );
        std::fs::write(&c, cert.pem()).unwrap();
        std::fs::write(&k, key.serialize_pem()).unwrap();
        (c, k)
    }

    fn ca(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

async fn tls_channel(addr: SocketAddr, ca_pem: &str, identity: Option<(&Path, &Path)>) -> Channel {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca_pem))
        .domain_name("localhost");
    if let Some((c, k)) = identity {
        tls = tls.identity(Identity::from_pem(
            std::fs::read(c).unwrap(),
            std::fs::read(k).unwrap(),
        ));
    }
    Channel::from_shared(format!("https://{addr}"))
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect()
        .await
        .expect("TLS connect")
}

fn request() -> pb::GenerateRequest {
    pb::GenerateRequest {
        prompt: Some(pb::generate_request::Prompt::Text("You may copy".into())),
        max_new_tokens: 3,
        ..Default::default()
    }
}

/// Calls through `channel` until one succeeds (the router's first polls of the worker).
async fn generate_when_ready(channel: Channel) -> Result<pb::GenerateResponse, tonic::Status> {
    let mut client = GenerationClient::new(channel);
    let start = Instant::now();
    loop {
        match client.generate(request()).await {
            Ok(r) => return Ok(r.into_inner()),
            Err(e)
                if e.code() == tonic::Code::Unavailable
                    && start.elapsed() < Duration::from_secs(3) =>
            {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            Err(e) => return Err(e),
        }
    }
}

/// HTTPS request to the router's HTTP front, trusting only the test CA.
fn https_post(addr: SocketAddr, ca_pem: &str, path: &str, body: &str) -> (u16, String) {
    use tokio_rustls::rustls;
    use tokio_rustls::rustls::pki_types::pem::PemObject;
    use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName};
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(ca_pem.as_bytes()).unwrap())
        .unwrap();
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let conn =
        rustls::ClientConnection::new(Arc::new(config), ServerName::try_from("localhost").unwrap())
            .unwrap();
    let tcp = std::net::TcpStream::connect(addr).unwrap();
    let mut tls = rustls::StreamOwned::new(conn, tcp);
    write!(
        tls,
        "POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = Vec::new();
    let _ = tls.read_to_end(&mut raw);
    let raw = String::from_utf8_lossy(&raw).into_owned();
    let status = raw[9..12].parse().unwrap();
    (status, raw.split_once("\r\n\r\n").unwrap().1.to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn public_endpoints_over_tls_and_mtls_between_router_and_worker() {
    let (pki, ca) = Pki::new("main");
    let (worker_cert, worker_key) = pki.issue(&ca, "worker", &["localhost", "127.0.0.1"]);
    let (router_cert, router_key) = pki.issue(&ca, "router", &["localhost", "127.0.0.1"]);
    let (client_cert, client_key) = pki.issue(&ca, "router-client", &["wavefront-router"]);
    let model = fixture("huginn");
    let worker = spawn(&[
        "worker",
        "--listen",
        "127.0.0.1:0",
        "--model",
        s(&model),
        "--tls-cert",
        s(&worker_cert),
        "--tls-key",
        s(&worker_key),
        "--tls-client-ca",
        s(&pki.ca()),
    ]);
    // The worker refuses a client without a certificate it trusts (the handshake fails).
    let no_identity = Channel::from_shared(format!("https://{}", worker.addr))
        .unwrap()
        .tls_config(
            ClientTlsConfig::new()
                .ca_certificate(Certificate::from_pem(&pki.ca_pem))
                .domain_name("localhost"),
        )
        .unwrap()
        .connect()
        .await;
    if let Ok(ch) = no_identity {
        let err = GenerationClient::new(ch)
            .generate(request())
            .await
            .expect_err("no client certificate");
        assert_ne!(err.code(), tonic::Code::Ok);
    }
    // With the client identity it answers.
    let direct = tls_channel(worker.addr, &pki.ca_pem, Some((&client_cert, &client_key))).await;
    generate_when_ready(direct)
        .await
        .expect("mTLS to the worker");

    // The router: TLS on its public gRPC and HTTP endpoints, mTLS to the worker.
    let http: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let workers = format!("127.0.0.1:{}", worker.addr.port());
    let router = spawn_router(
        "127.0.0.1:0",
        &workers,
        200,
        &[
            "--http-listen",
            &http.to_string(),
            "--tls-cert",
            s(&router_cert),
            "--tls-key",
            s(&router_key),
            "--worker-tls-ca",
            s(&pki.ca()),
            "--worker-tls-cert",
            s(&client_cert),
            "--worker-tls-key",
            s(&client_key),
        ],
    );
    let ch = tls_channel(router.addr, &pki.ca_pem, None).await;
    let r = generate_when_ready(ch)
        .await
        .expect("through the router over TLS and mTLS");
    assert_eq!(r.token_ids.len(), 3);
    // A plaintext client gets nothing from the TLS port.
    let plain = Channel::from_shared(format!("http://{}", router.addr))
        .unwrap()
        .connect()
        .await;
    if let Ok(ch) = plain {
        assert!(GenerationClient::new(ch).generate(request()).await.is_err());
    }
    // HTTPS, verified against the test CA.
    let ca_pem = pki.ca_pem.clone();
    let (status, body) = tokio::task::spawn_blocking(move || {
        https_post(
            http,
            &ca_pem,
            "/v1/completions",
            r#"{"prompt": "You may copy", "max_tokens": 3}"#,
        )
    })
    .await
    .unwrap();
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("text_completion"), "{body}");

    // A router without a client certificate cannot use the worker.
    let stranger = spawn_router(
        "127.0.0.1:0",
        &workers,
        200,
        &["--worker-tls-ca", s(&pki.ca())],
    );
    let err = GenerationClient::new(crate::harness::channel(stranger.addr).await)
        .generate(request())
        .await
        .expect_err("the worker refuses a router without a client certificate");
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
}
