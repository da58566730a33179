//! The subcommands.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use tokio::net::TcpListener;
use wavefront_net::{Listener, ServerLimits};
use wavefront_proto::auth::Secrets;
use wavefront_proto::v1 as pb;
use wavefront_proto::v1::generation_client::GenerationClient;
use wavefront_router::{Discovery, DiscoveryConfig, RouterService, ServerTls, WorkerTls};
use wavefront_schemes::{ReplayDraws, ServedModel};
use wavefront_worker::{RequestLimits, WorkerConfig, WorkerService};

use crate::args::{parse_listen, GenerationArgs, PromptArgs};
use crate::model_opts::ModelArgs;
use wavefront_router::json::{canvas_json, response_json};

/// Where a serving process publishes its metrics (the commands that run a server: `serve`,
/// `router`, `worker`, `run`; `wavefront --metrics-listen ADDR COMMAND` works too).
#[derive(Debug, Clone, Default, Args)]
pub struct MetricsArgs {
    /// Serve Prometheus metrics at http://ADDR/metrics (e.g. 0.0.0.0:9090; the address is
    /// printed). Unset: off, except for `serve`, which takes a free loopback port; empty: off.
    #[arg(long = "metrics-listen", env = "WAVEFRONT_METRICS_LISTEN")]
    pub metrics_listen: Option<String>,
}

#[derive(Debug, Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub metrics: MetricsArgs,
    /// Address the router listens on.
    #[arg(long, env = "WAVEFRONT_LISTEN", default_value = "127.0.0.1:50051")]
    pub listen: String,
    /// Also serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions,
    /// /v1/models, /health) on this address; port 0 picks a free port (printed).
    #[arg(long, env = "WAVEFRONT_HTTP_LISTEN")]
    pub http_listen: Option<String>,
    #[command(flatten)]
    pub auth: ApiKeyArgs,
    #[command(flatten)]
    pub tls: TlsArgs,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub limits: LimitArgs,
    #[command(flatten)]
    pub connections: ConnectionArgs,
    /// Seconds in-flight requests may run after SIGTERM or Ctrl-C (a second signal stops at
    /// once).
    #[arg(long, env = "WAVEFRONT_DRAIN_TIMEOUT_S", default_value_t = 30)]
    pub drain_timeout_s: u64,
    /// Largest request message the server decodes, in bytes; larger ones get
    /// RESOURCE_EXHAUSTED.
    #[arg(long, env = "WAVEFRONT_MAX_MESSAGE_BYTES", default_value_t = wavefront_proto::limits::DEFAULT_MAX_MESSAGE_BYTES)]
    pub max_message_bytes: usize,
}

/// API keys of the router's public endpoints (gRPC and HTTP; health stays open).
#[derive(Clone, Args)]
pub struct ApiKeyArgs {
    /// API keys the public endpoints require (`authorization: Bearer <key>`), comma
    /// separated; none: open.
    #[arg(
        long = "api-key",
        env = "WAVEFRONT_API_KEY",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub api_keys: Vec<String>,
    /// A file of API keys, one per line (`#` comments), read at start-up.
    #[arg(long, env = "WAVEFRONT_API_KEY_FILE")]
    pub api_key_file: Option<PathBuf>,
}

impl std::fmt::Debug for ApiKeyArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiKeyArgs")
            .field(
                "api_keys",
                &format_args!("{} redacted", self.api_keys.len()),
            )
            .field("api_key_file", &self.api_key_file)
            .finish()
    }
}

impl ApiKeyArgs {
    fn secrets(&self) -> Result<Secrets> {
        let file = match &self.api_key_file {
            Some(p) => Some(
                std::fs::read_to_string(p)
                    .with_context(|| format!("cannot read --api-key-file {}", p.display()))?,
            ),
            None => None,
        };
        Secrets::parse(&self.api_keys, file.as_deref())
            .map_err(|e| anyhow::anyhow!("--api-key: {e}"))
    }
}

/// The credential of router-to-worker calls.
#[derive(Clone, Args)]
pub struct WorkerTokenArg {
    /// Token the router sends on every worker call and the worker requires on every call but
    /// health (`authorization: Bearer <token>`); none: open.
    #[arg(long, env = "WAVEFRONT_WORKER_TOKEN", hide_env_values = true)]
    pub worker_token: Option<String>,
}

impl std::fmt::Debug for WorkerTokenArg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let set = if self.worker_token.is_some() {
            "redacted"
        } else {
            "none"
        };
        write!(f, "WorkerTokenArg({set})")
    }
}

impl WorkerTokenArg {
    fn secrets(&self) -> Result<Secrets> {
        Secrets::parse(self.worker_token.as_slice(), None)
            .map_err(|e| anyhow::anyhow!("--worker-token: {e}"))
    }
}

/// TLS of a server's endpoints.
#[derive(Debug, Clone, Args)]
pub struct TlsArgs {
    /// PEM certificate chain: serve over TLS (with --tls-key).
    #[arg(long, env = "WAVEFRONT_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, env = "WAVEFRONT_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
}

fn read_pem(flag: &str, path: &std::path::Path) -> Result<Vec<u8>> {
    std::fs::read(path).with_context(|| format!("cannot read {flag} {}", path.display()))
}

impl TlsArgs {
    /// The server TLS of these flags (clients must hold a certificate `client_ca` signed, when
    /// given).
    fn server(&self, client_ca: Option<&std::path::Path>) -> Result<Option<ServerTls>> {
        let (Some(cert), Some(key)) = (&self.tls_cert, &self.tls_key) else {
            if client_ca.is_some() {
                bail!("--tls-client-ca needs --tls-cert and --tls-key");
            }
            return Ok(None);
        };
        let ca = client_ca
            .map(|p| read_pem("--tls-client-ca", p))
            .transpose()?;
        ServerTls::from_pem(
            read_pem("--tls-cert", cert)?,
            read_pem("--tls-key", key)?,
            ca,
        )
        .map(Some)
        .map_err(|e| anyhow::anyhow!("--tls-cert / --tls-key: {e}"))
    }
}

/// How the router reaches workers over TLS.
#[derive(Debug, Clone, Args)]
pub struct WorkerTlsArgs {
    /// PEM CA the workers' certificates are verified by: call workers over TLS. A worker's
    /// certificate must name the host of its --workers target (DNS name or IP address).
    #[arg(long, env = "WAVEFRONT_WORKER_TLS_CA")]
    pub worker_tls_ca: Option<PathBuf>,
    /// PEM client certificate the router presents to workers (mTLS; with --worker-tls-key).
    #[arg(long, env = "WAVEFRONT_WORKER_TLS_CERT", requires_all = ["worker_tls_key", "worker_tls_ca"])]
    pub worker_tls_cert: Option<PathBuf>,
    /// PEM private key of --worker-tls-cert.
    #[arg(long, env = "WAVEFRONT_WORKER_TLS_KEY", requires = "worker_tls_cert")]
    pub worker_tls_key: Option<PathBuf>,
}

impl WorkerTlsArgs {
    fn config(&self) -> Result<Option<WorkerTls>> {
        let Some(ca) = &self.worker_tls_ca else {
            return Ok(None);
        };
        let identity = match (&self.worker_tls_cert, &self.worker_tls_key) {
            (Some(c), Some(k)) => Some((
                read_pem("--worker-tls-cert", c)?,
                read_pem("--worker-tls-key", k)?,
            )),
            _ => None,
        };
        Ok(Some(WorkerTls::new(
            read_pem("--worker-tls-ca", ca)?,
            identity,
        )))
    }
}

/// What one request may ask of a worker; beyond it, INVALID_ARGUMENT with a message.
#[derive(Debug, Clone, Args)]
pub struct LimitArgs {
    /// Longest prompt in tokens (default: the model's context limit).
    #[arg(long, env = "WAVEFRONT_MAX_PROMPT_TOKENS")]
    pub max_prompt_tokens: Option<usize>,
    /// Largest max_new_tokens a request may ask for.
    #[arg(long, env = "WAVEFRONT_MAX_NEW_TOKENS_LIMIT", default_value_t = wavefront_worker::limits::DEFAULT_MAX_NEW_TOKENS)]
    pub max_new_tokens_limit: usize,
    /// Most stop strings, and most stop token ids, in one request.
    #[arg(long, env = "WAVEFRONT_MAX_STOP_SEQUENCES", default_value_t = wavefront_worker::limits::DEFAULT_MAX_STOP_SEQUENCES)]
    pub max_stop_sequences: usize,
    /// Longest stop string, in bytes.
    #[arg(long, env = "WAVEFRONT_MAX_STOP_STRING_BYTES", default_value_t = wavefront_worker::limits::DEFAULT_MAX_STOP_STRING_BYTES)]
    pub max_stop_string_bytes: usize,
    /// Most messages in one chat prompt.
    #[arg(long, env = "WAVEFRONT_MAX_CHAT_MESSAGES", default_value_t = wavefront_worker::limits::DEFAULT_MAX_CHAT_MESSAGES)]
    pub max_chat_messages: usize,
}

impl LimitArgs {
    fn limits(&self) -> Result<RequestLimits> {
        if self.max_prompt_tokens == Some(0) || self.max_new_tokens_limit == 0 {
            bail!("--max-prompt-tokens and --max-new-tokens-limit must be at least 1");
        }
        Ok(RequestLimits {
            max_prompt_tokens: self.max_prompt_tokens,
            max_new_tokens: self.max_new_tokens_limit,
            max_stop_sequences: self.max_stop_sequences,
            max_stop_string_bytes: self.max_stop_string_bytes,
            max_chat_messages: self.max_chat_messages,
        })
    }
}

/// What the servers allow each connection (every gRPC and HTTP listener of the command).
#[derive(Debug, Clone, Args)]
pub struct ConnectionArgs {
    /// Connections open at once on each listener; more wait in the backlog until one closes.
    #[arg(long, env = "WAVEFRONT_MAX_CONNECTIONS", default_value_t = wavefront_net::DEFAULT_MAX_CONNECTIONS)]
    pub max_connections: usize,
    /// Seconds a new connection may stay silent, an HTTP/1 request may take to send its
    /// headers, and a kept-alive HTTP/1 connection may wait for its next request.
    #[arg(long, env = "WAVEFRONT_HEADER_READ_TIMEOUT_S", default_value_t = wavefront_net::DEFAULT_HEADER_READ_TIMEOUT.as_secs())]
    pub header_read_timeout_s: u64,
    /// Seconds an HTTP request may take to send its whole body.
    #[arg(long, env = "WAVEFRONT_BODY_READ_TIMEOUT_S", default_value_t = wavefront_net::DEFAULT_BODY_READ_TIMEOUT.as_secs())]
    pub body_read_timeout_s: u64,
    /// Seconds without a byte in either direction after which a connection is closed (gRPC
    /// keep-alive pings count; a unary HTTP request that computes longer without output must
    /// stream).
    #[arg(long, env = "WAVEFRONT_IDLE_TIMEOUT_S", default_value_t = wavefront_net::DEFAULT_IDLE_TIMEOUT.as_secs())]
    pub idle_timeout_s: u64,
    /// Seconds between HTTP/2 keep-alive pings (0: none); a ping unanswered for 20 s closes
    /// the connection.
    #[arg(long, env = "WAVEFRONT_KEEPALIVE_INTERVAL_S", default_value_t = wavefront_net::DEFAULT_KEEPALIVE_INTERVAL.as_secs())]
    pub keepalive_interval_s: u64,
    /// Concurrent HTTP/2 streams (gRPC calls) on one connection.
    #[arg(long, env = "WAVEFRONT_MAX_STREAMS_PER_CONNECTION", default_value_t = wavefront_net::DEFAULT_MAX_STREAMS)]
    pub max_streams_per_connection: u32,
    /// Refusals per second answered at once to one client address (IPv6: one /64) on the
    /// router's gRPC and HTTP listeners together: malformed, oversized or unauthenticated requests,
    /// unknown models. Past `--refusal-burst` of them, the address's further refusals are
    /// held until it is back within this rate (at most 30 s); its valid requests, and every
    /// other client's, are never held. 0: refusals are never held.
    #[arg(long, env = "WAVEFRONT_REFUSALS_PER_SECOND", default_value_t = wavefront_net::DEFAULT_REFUSALS_PER_SECOND)]
    pub refusals_per_second: u32,
    /// Refusals one client address may have answered at once before `--refusals-per-second`
    /// holds them.
    #[arg(long, env = "WAVEFRONT_REFUSAL_BURST", default_value_t = wavefront_net::DEFAULT_REFUSAL_BURST)]
    pub refusal_burst: u32,
}

impl ConnectionArgs {
    pub fn limits(&self) -> Result<ServerLimits> {
        if self.max_connections == 0 || self.max_streams_per_connection == 0 {
            bail!("--max-connections and --max-streams-per-connection must be at least 1");
        }
        if self.header_read_timeout_s == 0
            || self.body_read_timeout_s == 0
            || self.idle_timeout_s == 0
        {
            bail!(
                "--header-read-timeout-s, --body-read-timeout-s and --idle-timeout-s must be at \
                 least 1"
            );
        }
        if self.refusals_per_second > 0 && self.refusal_burst == 0 {
            bail!("--refusal-burst must be at least 1 (or --refusals-per-second 0: no budget)");
        }
        if self.keepalive_interval_s >= self.idle_timeout_s {
            bail!(
                "--keepalive-interval-s ({}) must be shorter than --idle-timeout-s ({}), or \
                 healthy idle gRPC connections are closed",
                self.keepalive_interval_s,
                self.idle_timeout_s
            );
        }
        Ok(ServerLimits {
            max_connections: self.max_connections,
            header_read_timeout: Duration::from_secs(self.header_read_timeout_s),
            body_read_timeout: Duration::from_secs(self.body_read_timeout_s),
            idle_timeout: Duration::from_secs(self.idle_timeout_s),
            keepalive_interval: (self.keepalive_interval_s > 0)
                .then(|| Duration::from_secs(self.keepalive_interval_s)),
            keepalive_timeout: wavefront_net::DEFAULT_KEEPALIVE_TIMEOUT,
            max_streams: self.max_streams_per_connection,
            refusals: wavefront_net::RefusalBudget {
                per_second: self.refusals_per_second,
                burst: self.refusal_burst,
            },
        })
    }
}

#[derive(Debug, Args)]
pub struct RouterArgs {
    #[command(flatten)]
    pub metrics: MetricsArgs,
    /// Address to listen on (port 0 picks a free port; the bound address is printed).
    #[arg(long, env = "WAVEFRONT_LISTEN", default_value = "0.0.0.0:50051")]
    pub listen: String,
    /// Worker targets, HOST:PORT, comma separated; a DNS name may resolve to many workers.
    #[arg(
        long,
        env = "WAVEFRONT_WORKERS",
        value_delimiter = ',',
        required = true
    )]
    pub workers: Vec<String>,
    /// Also serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions,
    /// /v1/models, /health) on this address; port 0 picks a free port (printed).
    #[arg(long, env = "WAVEFRONT_HTTP_LISTEN")]
    pub http_listen: Option<String>,
    #[command(flatten)]
    pub auth: ApiKeyArgs,
    #[command(flatten)]
    pub worker_token: WorkerTokenArg,
    #[command(flatten)]
    pub tls: TlsArgs,
    #[command(flatten)]
    pub worker_tls: WorkerTlsArgs,
    /// How often workers are re-resolved and polled for load, in ms.
    #[arg(long, env = "WAVEFRONT_REFRESH_MS", default_value_t = 1000)]
    pub refresh_ms: u64,
    /// Move requests off a worker whose admission queue is not empty onto another worker of
    /// the same model that has room (queues nothing, runs fewer than its --max-active); a
    /// running request moves with its state, a queued one starts over there; each request
    /// moves at most once this way. Requests always move off a draining worker.
    #[arg(long, env = "WAVEFRONT_REBALANCE")]
    pub rebalance: bool,
    /// The model a request that names none is sent to while the workers serve several (with
    /// one served, that one; without this, such a request is INVALID_ARGUMENT).
    #[arg(long, env = "WAVEFRONT_DEFAULT_MODEL")]
    pub default_model: Option<String>,
    #[command(flatten)]
    pub connections: ConnectionArgs,
    /// Largest request message the server decodes, in bytes; larger ones get
    /// RESOURCE_EXHAUSTED.
    #[arg(long, env = "WAVEFRONT_MAX_MESSAGE_BYTES", default_value_t = wavefront_proto::limits::DEFAULT_MAX_MESSAGE_BYTES)]
    pub max_message_bytes: usize,
}

#[derive(Debug, Args)]
pub struct WorkerArgs {
    #[command(flatten)]
    pub metrics: MetricsArgs,
    /// Address to listen on (port 0 picks a free port; the bound address is printed).
    #[arg(long, env = "WAVEFRONT_LISTEN", default_value = "0.0.0.0:50061")]
    pub listen: String,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub limits: LimitArgs,
    #[command(flatten)]
    pub worker_token: WorkerTokenArg,
    #[command(flatten)]
    pub tls: TlsArgs,
    /// PEM CA that clients' certificates must be signed by (mTLS; with --tls-cert).
    #[arg(long, env = "WAVEFRONT_TLS_CLIENT_CA")]
    pub tls_client_ca: Option<PathBuf>,
    /// Seconds in-flight requests may run after SIGTERM or Ctrl-C (a second signal stops at
    /// once).
    #[arg(long, env = "WAVEFRONT_DRAIN_TIMEOUT_S", default_value_t = 30)]
    pub drain_timeout_s: u64,
    #[command(flatten)]
    pub connections: ConnectionArgs,
    /// Largest request message the server decodes, in bytes; larger ones get
    /// RESOURCE_EXHAUSTED.
    #[arg(long, env = "WAVEFRONT_MAX_MESSAGE_BYTES", default_value_t = wavefront_proto::limits::DEFAULT_MAX_MESSAGE_BYTES)]
    pub max_message_bytes: usize,
}

#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// Router or worker address.
    #[arg(long, env = "WAVEFRONT_ADDR", default_value = "http://127.0.0.1:50051")]
    pub addr: String,
    #[command(flatten)]
    pub prompt: PromptArgs,
    #[command(flatten)]
    pub generation: GenerationArgs,
    /// Print one JSON object instead of streaming text.
    #[arg(long)]
    pub json: bool,
    /// Deadline of the call in ms (sent as grpc-timeout).
    #[arg(long)]
    pub timeout_ms: Option<u64>,
}

#[derive(Debug, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub metrics: MetricsArgs,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub prompt: PromptArgs,
    #[command(flatten)]
    pub generation: GenerationArgs,
    /// Print one JSON object (token ids, text, finish reason, stats).
    #[arg(long)]
    pub json: bool,
    /// Replay recorded initial-state draws from this safetensors file
    /// instead of the seeded RNG (reproduces reference runs exactly).
    #[arg(long)]
    pub replay_draws: Option<PathBuf>,
    /// Tensor in --replay-draws to use (default: the only `*init_draws` tensor).
    #[arg(long, conflicts_with = "replay_run")]
    pub replay_tensor: Option<String>,
    /// entropy-bound (DiffusionGemma): replay the one-row run NAME recorded in --replay-draws
    /// as the fixture records runs (`run.NAME.initial_canvas_draws`, `run.NAME.step.multinomial`,
    /// `run.NAME.step.renoise_draw`, `run.NAME.step.canvas_index`).
    #[arg(long, requires = "replay_draws")]
    pub replay_run: Option<String>,
}

/// The first SIGINT or SIGTERM.
async fn signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("SIGTERM handler");
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

/// Resolves at the first SIGINT or SIGTERM, which starts a graceful shutdown; a second one
/// exits at once (status 130).
async fn shutdown_signal() {
    signal().await;
    tracing::info!("shutting down: new requests are refused, requests in flight finish (up to --drain-timeout-s); signal again to stop at once");
    eprintln!(
        "wavefront: shutting down after the requests in flight; press Ctrl-C again to stop now"
    );
    tokio::spawn(async {
        signal().await;
        eprintln!("wavefront: stopped at once by a second signal");
        std::process::exit(130);
    });
}

fn load(model: &ModelArgs) -> Result<Arc<dyn ServedModel>> {
    let (files, name) = model.files()?;
    let opts = model.load_options(name, &files)?;
    Ok(wavefront_schemes::load_model(files, opts)?)
}

fn announce(role: &str, addr: SocketAddr) {
    // Scripts and tests read this line: keep its shape.
    println!("wavefront {role} listening on {addr}");
    let _ = std::io::stdout().flush();
}

async fn bind(listen: &str) -> Result<TcpListener> {
    let addr = parse_listen(listen)?;
    TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr}"))
}

pub async fn worker(a: WorkerArgs) -> Result<()> {
    let limits = a.limits.limits()?;
    let server_limits = a.connections.limits()?;
    let listener = bind(&a.listen).await?;
    let model = tokio::task::spawn_blocking({
        let m = a.model.clone();
        move || load(&m)
    })
    .await??;
    let addr = listener.local_addr()?;
    let service = WorkerService::new(vec![model], addr.to_string()).with_limits(limits);
    announce("worker", addr);
    let cfg = WorkerConfig {
        drain_timeout: Duration::from_secs(a.drain_timeout_s),
        max_message_bytes: a.max_message_bytes,
        token: a.worker_token.secrets()?,
        tls: a.tls.server(a.tls_client_ca.as_deref())?.map(|t| t.grpc()),
    };
    let listener = Listener::new(listener, server_limits, "grpc");
    wavefront_worker::serve(service, listener, cfg, shutdown_signal()).await
}

pub async fn router(a: RouterArgs) -> Result<()> {
    if a.refresh_ms == 0 {
        bail!("--refresh-ms must be at least 1");
    }
    let api_keys = a.auth.secrets()?;
    let tls = a.tls.server(None)?;
    let server_limits = a.connections.limits()?;
    let listener = bind(&a.listen).await?;
    let discovery = Discovery::default();
    let cfg = DiscoveryConfig {
        targets: a.workers.clone(),
        refresh: Duration::from_millis(a.refresh_ms),
        poll_timeout: Duration::from_millis(a.refresh_ms.clamp(200, 2000)),
        forget_after: Duration::from_millis(a.refresh_ms * 10),
        worker_token: a.worker_token.secrets()?,
        worker_tls: a.worker_tls.config()?,
    };
    let http = match &a.http_listen {
        Some(l) => Some(bind(l).await?),
        None => None,
    };
    discovery.refresh(&cfg).await;
    tokio::spawn(discovery.clone().run(cfg));
    announce("router", listener.local_addr()?);
    let mut service = RouterService::new(discovery)
        .with_max_message_bytes(a.max_message_bytes)
        .with_api_keys(api_keys)
        .with_rebalance(a.rebalance)
        .with_default_model(a.default_model.clone());
    if let Some(tls) = tls {
        service = service.with_tls(tls);
    }
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let listener = Listener::new(listener, server_limits, "grpc");
    let http_task = spawn_http(http, &service, server_limits, &listener, &stop_rx)?;
    let signal = async move {
        shutdown_signal().await;
        let _ = stop_tx.send(true);
    };
    let mut rx = stop_rx;
    let grpc = wavefront_router::serve(service, listener, async move {
        let _ = rx.changed().await;
    });
    let (r, _) = tokio::join!(grpc, signal);
    r?;
    if let Some(t) = http_task {
        t.await??;
    }
    Ok(())
}

/// Starts the OpenAI-compatible HTTP front on `listener` (when given) over `service`, until
/// `stop` changes; announces its address. A client address's refusals count against one
/// budget on it and on the router's gRPC listener `grpc`.
fn spawn_http(
    listener: Option<TcpListener>,
    service: &RouterService,
    limits: ServerLimits,
    grpc: &Listener,
    stop: &tokio::sync::watch::Receiver<bool>,
) -> Result<Option<tokio::task::JoinHandle<Result<()>>>> {
    let Some(listener) = listener else {
        return Ok(None);
    };
    announce("router http", listener.local_addr()?);
    let mut rx = stop.clone();
    let max = service.max_message_bytes();
    Ok(Some(tokio::spawn(wavefront_router::serve_http(
        service.clone(),
        Listener::new(listener, limits, "http").sharing_refusals(grpc),
        max,
        async move {
            let _ = rx.changed().await;
        },
    ))))
}

pub async fn serve(a: ServeArgs) -> Result<()> {
    let limits = a.limits.limits()?;
    let server_limits = a.connections.limits()?;
    let api_keys = a.auth.secrets()?;
    let tls = a.tls.server(None)?;
    // The in-process worker listens on loopback: a random token keeps other local users out
    // when the public endpoints need a key.
    let worker_token = if api_keys.is_empty() {
        Secrets::default()
    } else {
        let token = format!("{:032x}", rand::random::<u128>());
        Secrets::parse(&[token], None).map_err(anyhow::Error::msg)?
    };
    let listener = bind(&a.listen).await?;
    let http = match &a.http_listen {
        Some(l) => Some(bind(l).await?),
        None => None,
    };
    // One in-process worker per model, each on its own loopback port, as a deployment runs
    // them: the router finds each model on its worker by name.
    let models = tokio::task::spawn_blocking({
        let m = a.model.clone();
        move || -> Result<Vec<Arc<dyn ServedModel>>> {
            m.serve_files()?
                .into_iter()
                .map(|(files, name)| {
                    let opts = m.load_options(name.clone(), &files)?;
                    wavefront_schemes::load_model(files, opts)
                        .with_context(|| format!("cannot load model {name}"))
                })
                .collect()
        }
    })
    .await??;
    let names: Vec<String> = models.iter().map(|m| m.info().name.clone()).collect();
    let default_model = names.first().cloned();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut worker_addrs = Vec::new();
    let mut worker_tasks = Vec::new();
    for model in models {
        let worker_listener = TcpListener::bind("127.0.0.1:0").await?;
        let worker_addr = worker_listener.local_addr()?;
        tracing::info!(
            model = %model.info().name,
            family = model.info().family,
            worker = %worker_addr,
            "worker started"
        );
        let service = WorkerService::new(vec![model], worker_addr.to_string()).with_limits(limits);
        let mut rx = stop_rx.clone();
        worker_tasks.push(tokio::spawn(wavefront_worker::serve(
            service,
            Listener::new(worker_listener, server_limits, "grpc"),
            WorkerConfig {
                drain_timeout: Duration::from_secs(a.drain_timeout_s),
                max_message_bytes: a.max_message_bytes,
                token: worker_token.clone(),
                ..WorkerConfig::default()
            },
            async move {
                let _ = rx.changed().await;
            },
        )));
        worker_addrs.push(worker_addr.to_string());
    }
    let discovery = Discovery::default();
    let cfg = DiscoveryConfig {
        targets: worker_addrs.clone(),
        refresh: Duration::from_millis(500),
        poll_timeout: Duration::from_millis(1000),
        forget_after: Duration::from_secs(10),
        worker_token,
        worker_tls: None,
    };
    // Ready only once the router sees every worker.
    for _ in 0..100 {
        discovery.refresh(&cfg).await;
        if discovery.snapshot().iter().filter(|w| w.up).count() == worker_addrs.len() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The workers are this process's own: when they stop at shutdown the router does not
    // warn that they stopped answering.
    let polling = tokio::spawn(discovery.clone().run(cfg));
    let addr = listener.local_addr()?;
    tracing::info!(models = %names.join(","), %addr, workers = %worker_addrs.join(","), "serving");
    announce("router", addr);
    let mut service = RouterService::new(discovery)
        .with_max_message_bytes(a.max_message_bytes)
        .with_api_keys(api_keys)
        .with_default_model(default_model);
    if let Some(tls) = tls {
        service = service.with_tls(tls);
    }
    let listener = Listener::new(listener, server_limits, "grpc");
    let http_task = spawn_http(http, &service, server_limits, &listener, &stop_rx)?;
    let mut rx = stop_rx;
    let router = wavefront_router::serve(service, listener, async move {
        let _ = rx.changed().await;
    });
    let signal = async move {
        shutdown_signal().await;
        polling.abort();
        let _ = stop_tx.send(true);
    };
    let (r, _) = tokio::join!(router, signal);
    r?;
    for t in worker_tasks {
        t.await??;
    }
    if let Some(t) = http_task {
        t.await??;
    }
    Ok(())
}

pub async fn generate(a: GenerateArgs) -> Result<()> {
    let body = a.generation.to_request(&a.prompt)?;
    let mut client = GenerationClient::connect(a.addr.clone())
        .await
        .with_context(|| format!("cannot connect to {}", a.addr))?;
    let mut req = tonic::Request::new(body);
    if let Some(ms) = a.timeout_ms {
        req.set_timeout(Duration::from_millis(ms));
    }
    let mut stream = client
        .generate_stream(req)
        .await
        .map_err(status_error)?
        .into_inner();
    let mut out = std::io::stdout();
    while let Some(msg) = stream.message().await.map_err(status_error)? {
        match msg.event {
            // With --json, stdout is JSON lines; else it is the text, and canvas lines go to
            // stderr so that they do not break it.
            Some(pb::generate_stream_response::Event::Canvas(c)) if a.json => {
                println!("{}", canvas_json(&c));
            }
            Some(pb::generate_stream_response::Event::Canvas(c)) => {
                eprintln!("{}", canvas_json(&c));
            }
            Some(pb::generate_stream_response::Event::Tokens(chunk)) if !a.json => {
                write!(out, "{}", chunk.text)?;
                out.flush()?;
            }
            Some(pb::generate_stream_response::Event::Done(done)) => {
                if a.json {
                    println!("{}", response_json(&done));
                } else {
                    writeln!(out)?;
                }
                return Ok(());
            }
            _ => {}
        }
    }
    bail!("the stream ended without a final message")
}

fn status_error(s: tonic::Status) -> anyhow::Error {
    anyhow::anyhow!("{:?}: {}", s.code(), s.message())
}

pub async fn run(a: RunArgs) -> Result<()> {
    // `run` has one model: --model-name picks an embedded one when --model is not given, and
    // must otherwise name the model that is run.
    let mut m = a.model.clone();
    let asked = a.prompt.model_name.clone();
    if m.model.is_none() && !asked.is_empty() {
        m.model = Some(PathBuf::from(&asked));
    }
    let model = tokio::task::spawn_blocking(move || load(&m)).await??;
    if !asked.is_empty() && asked != model.info().name {
        bail!(
            "--model-name {asked:?} is not the model this runs ({:?}); `run` serves one model: \
             choose it with --model (a directory or an embedded name)",
            model.info().name
        );
    }
    let body = a.generation.to_request(&a.prompt)?;
    let mut spec =
        wavefront_worker::convert::spec_from_proto(&body, model.as_ref()).map_err(status_error)?;
    if let Some(path) = &a.replay_draws {
        let draws = match &a.replay_run {
            Some(run) => {
                let tensors = wavefront_models::candle_core::safetensors::load(
                    path,
                    &wavefront_models::candle_core::Device::Cpu,
                )
                .with_context(|| format!("cannot read {}", path.display()))?;
                wavefront_schemes::uniform_diffusion::run_draws(&tensors, run)
                    .with_context(|| format!("--replay-run {run} in {}", path.display()))?
            }
            None => read_draws(path, a.replay_tensor.as_deref())?,
        };
        spec.replay_draws = Some(Arc::new(draws));
    }
    let json = a.json;
    let stop_strings = body.stop_strings.clone();
    let skip_special = body.skip_special_tokens.unwrap_or(true);
    // Token texts of the log-probabilities, after the run has shut the engine down.
    let scorer = model.clone();
    let result = tokio::task::spawn_blocking(move || {
        let mut out = std::io::stdout();
        let res = wavefront_worker::generate_blocking(
            model.as_ref(),
            spec,
            stop_strings,
            skip_special,
            None,
            |d| {
                if !json {
                    let _ = write!(out, "{}", d.text);
                    let _ = out.flush();
                }
            },
            |frame| {
                // Beside streamed text, canvas lines go to stderr (see `generate`).
                let event = wavefront_worker::convert::canvas_event(frame);
                if json {
                    println!("{}", canvas_json(&event));
                } else {
                    eprintln!("{}", canvas_json(&event));
                }
            },
        );
        model.shutdown();
        res
    })
    .await?
    .map_err(|e| status_error(wavefront_worker::status::from_engine_error(&e)))?;
    let logprobs =
        wavefront_worker::convert::logprobs(scorer.as_ref(), &result.token_ids, &result.logprobs);
    let (prompt_logprobs, prompt_text) = match &result.prompt {
        Some((ids, lps)) => (
            wavefront_worker::convert::logprobs(scorer.as_ref(), ids, lps),
            scorer.decode_text(ids, skip_special),
        ),
        None => (Vec::new(), String::new()),
    };
    let resp = pb::GenerateResponse {
        index: 0,
        choices: Vec::new(),
        model: String::new(),
        logprobs,
        prompt_logprobs,
        prompt_text,
        text: result.text,
        token_ids: result.token_ids,
        finish_reason: wavefront_worker::convert::finish_reason(result.finish_reason) as i32,
        stats: Some(wavefront_worker::convert::stats(&result.stats, result.seed)),
    };
    if json {
        println!("{}", response_json(&resp));
    } else {
        println!();
    }
    Ok(())
}

fn read_draws(path: &PathBuf, name: Option<&str>) -> Result<ReplayDraws> {
    use wavefront_models::candle_core::{safetensors, DType, Device};
    let tensors = safetensors::load(path, &Device::Cpu)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let key = match name {
        Some(n) => n.to_owned(),
        None => {
            let mut keys: Vec<&String> = tensors
                .keys()
                .filter(|k| k.ends_with("init_draws"))
                .collect();
            keys.sort();
            match keys.as_slice() {
                [one] => (*one).clone(),
                [] => bail!(
                    "{} holds no `*init_draws` tensor; name one with --replay-tensor",
                    path.display()
                ),
                many => bail!(
                    "{} holds several draw tensors ({}); pick one with --replay-tensor",
                    path.display(),
                    many.iter()
                        .map(|s| s.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            }
        }
    };
    let t = tensors
        .get(&key)
        .with_context(|| format!("no tensor {key:?} in {}", path.display()))?;
    let (rows, dim) = t
        .dims2()
        .with_context(|| format!("{key} must be [rows, dim]"))?;
    let data = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    debug_assert_eq!(data.len(), rows * dim);
    Ok(ReplayDraws { dim, data })
}

#[derive(Debug, Args)]
pub struct ExportGgufArgs {
    /// The model to write: a Hugging Face directory, a GGUF file or an embedded model's name
    /// (huginn, llada, refusion, armt).
    #[arg(long)]
    pub model: PathBuf,
    /// The GGUF file to write.
    #[arg(long)]
    pub out: PathBuf,
    /// Block format of the matrices: f32 (exact), f16, q8_0, q4_0, q4_k or q6_k. A matrix whose
    /// rows do not split into the format's blocks falls back to q8_0, else f32; vectors (norms,
    /// biases) stay f32.
    #[arg(long = "type", default_value = "q8_0")]
    pub quant: String,
}

/// `export-gguf`: one GGUF file of wavefront's layout, read back by `--model FILE`.
pub fn export_gguf(a: ExportGgufArgs) -> Result<()> {
    use wavefront_models::gguf::GgufQuant;
    let quant: GgufQuant = a
        .quant
        .parse()
        .map_err(|e| anyhow::anyhow!("--type: {e}"))?;
    let (files, _) = crate::model_opts::resolve(Some(&a.model), None)?;
    let report = files
        .export_gguf(&a.out, quant)
        .with_context(|| format!("cannot write {}", a.out.display()))?;
    let mut counts: std::collections::BTreeMap<String, usize> = Default::default();
    for (_, format) in &report.tensors {
        *counts.entry(format!("{format:?}")).or_default() += 1;
    }
    let counts: Vec<String> = counts.iter().map(|(f, n)| format!("{n} {f}")).collect();
    println!(
        "wrote {} ({} bytes; tensors: {})",
        a.out.display(),
        report.bytes,
        counts.join(", ")
    );
    Ok(())
}
