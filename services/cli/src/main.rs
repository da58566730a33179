//! `wavefront`: serve, route, work, generate, run.
//!
//! `main` parses one typed config (flags with environment fallbacks),
//! validates it, builds what the subcommand needs, and waits for a signal.
//! Nothing below `main` reads the environment.

mod args;
mod commands;
mod embedded;
mod memory;
mod model_opts;

use anyhow::Result;
use clap::{Parser, Subcommand};
use wavefront_telemetry::{LogFormat, TelemetryConfig};

#[derive(Debug, Parser)]
#[command(
    name = "wavefront",
    version,
    about = "Serving for language models that do not decode one token per forward pass"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Log filter (tracing EnvFilter syntax).
    #[arg(long, global = true, env = "RUST_LOG", default_value = "info")]
    log_filter: String,
    /// Log line format: text or json.
    #[arg(
        long,
        global = true,
        env = "WAVEFRONT_LOG_FORMAT",
        default_value = "text"
    )]
    log_format: LogFormat,
    /// OTLP/gRPC endpoint for traces (e.g. http://localhost:4317); unset disables export.
    #[arg(long, global = true, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    otlp_endpoint: Option<String>,
    /// Serve Prometheus metrics at http://ADDR/metrics (e.g. 0.0.0.0:9090; the address is
    /// printed), for the serving commands (`serve`, `router`, `worker`, `run`), which also take
    /// it after their name. Unset: off, except for `serve`, which takes a free loopback port;
    /// empty: off. (`WAVEFRONT_METRICS_LISTEN` is read by those commands.)
    #[arg(long)]
    metrics_listen: Option<String>,
    /// Threads the CPU kernels split each forward over (0: one per core of the machine).
    #[arg(long, global = true, env = "WAVEFRONT_THREADS", default_value_t = 0)]
    threads: usize,
    /// Threads of the network runtime (gRPC and HTTP servers, the router's calls). 0 picks: a
    /// quarter of the cores (at least one) where this process runs a model on the CPU
    /// (`serve`, `worker` and `run` with --device cpu), whose kernels split each forward over
    /// every core, so that a flood of requests to answer or refuse cannot preempt them on all
    /// cores at once; one per core otherwise.
    #[arg(
        long,
        global = true,
        env = "WAVEFRONT_NETWORK_THREADS",
        default_value_t = 0
    )]
    network_threads: usize,
    /// Fraction of new traces sampled.
    #[arg(
        long,
        global = true,
        env = "WAVEFRONT_TRACE_SAMPLING_RATIO",
        default_value_t = 1.0
    )]
    trace_sampling_ratio: f64,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Router and workers on loopback in one process: one worker per embedded model (huginn,
    /// llada, refusion, armt), or one for --model.
    Serve(commands::ServeArgs),
    /// The stateless router.
    Router(commands::RouterArgs),
    /// A worker serving one model.
    Worker(commands::WorkerArgs),
    /// Client: call a router or worker and print the result.
    Generate(Box<commands::GenerateArgs>),
    /// Offline: load a model and generate without any server; prints JSON with --json.
    Run(Box<commands::RunArgs>),
    /// Offline: write a model (a directory, an embedded model or a GGUF file) as one GGUF
    /// file, its matrices in a llama.cpp block format, for `--model FILE.gguf`.
    ExportGguf(commands::ExportGgufArgs),
}

fn main() -> std::process::ExitCode {
    match run(Cli::parse()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", message(&e));
            std::process::ExitCode::FAILURE
        }
    }
}

/// Whether `command` runs a model on this machine's CPU (its kernels then use every core).
fn model_on_cpu(command: &Command) -> bool {
    let device = match command {
        Command::Serve(a) => &a.model.device,
        Command::Worker(a) => &a.model.device,
        Command::Run(a) => &a.model.device,
        Command::Router(_) | Command::Generate(_) | Command::ExportGguf(_) => return false,
    };
    device.trim().eq_ignore_ascii_case("cpu")
}

/// The error and its causes, each said once: a cause whose text its error already quotes is
/// not repeated.
fn message(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if out.contains(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out
}

fn run(cli: Cli) -> Result<()> {
    if !(0.0..=1.0).contains(&cli.trace_sampling_ratio) {
        anyhow::bail!(
            "--trace-sampling-ratio must be in [0, 1], got {}",
            cli.trace_sampling_ratio
        );
    }
    let service_name = match &cli.command {
        Command::Serve(_) => "wavefront",
        Command::Router(_) => "wavefront-router",
        Command::Worker(_) => "wavefront-worker",
        Command::Generate(_) => "wavefront-client",
        Command::Run(_) => "wavefront-run",
        Command::ExportGguf(_) => "wavefront-export",
    };
    let threads = match cli.threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    // candle keeps a spinning pool of its own for its elementwise ops; with the kernels' pool
    // on every core it only competes for them, so candle runs its few remaining ops inline.
    if std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        std::env::set_var("CANDLE_NUM_THREADS", "1");
    }
    wavefront_models::tune_allocator();
    wavefront_models::init_cpu_threads(threads).map_err(anyhow::Error::msg)?;
    let telemetry = TelemetryConfig {
        service_name: service_name.into(),
        log_filter: cli.log_filter.clone(),
        log_format: cli.log_format,
        otlp_endpoint: cli.otlp_endpoint.clone().filter(|s| !s.is_empty()),
        sampling_ratio: cli.trace_sampling_ratio,
    };
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let runtime_threads = match cli.network_threads {
        0 if model_on_cpu(&cli.command) => cores.div_ceil(4),
        0 => cores,
        n => n,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(runtime_threads)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let _guard = wavefront_telemetry::init(&telemetry)?;
        if let Some((soft, hard)) = wavefront_net::raise_descriptor_limit() {
            tracing::debug!(soft, hard, "open descriptor limit");
        }
        let own = match &cli.command {
            Command::Serve(a) => a.metrics.metrics_listen.clone(),
            Command::Router(a) => a.metrics.metrics_listen.clone(),
            Command::Worker(a) => a.metrics.metrics_listen.clone(),
            Command::Run(a) => a.metrics.metrics_listen.clone(),
            Command::Generate(_) | Command::ExportGguf(_) => None,
        };
        // `generate` is a client: it has no metrics to serve (the variable, set for a pod's
        // server, is ignored there).
        let serving = !matches!(cli.command, Command::Generate(_) | Command::ExportGguf(_));
        let metrics_listen = cli
            .metrics_listen
            .clone()
            .filter(|_| serving)
            .or(own)
            .or_else(|| matches!(cli.command, Command::Serve(_)).then(|| "127.0.0.1:0".to_owned()));
        if let Some(addr) = metrics_listen.as_deref().filter(|s| !s.is_empty()) {
            let addr =
                args::parse_listen(addr).map_err(|e| anyhow::anyhow!("--metrics-listen: {e}"))?;
            let bound = wavefront_telemetry::metrics::install_prometheus(addr)
                .map_err(anyhow::Error::msg)?;
            // On stderr: stdout carries the API's address line and `--json` output.
            eprintln!("wavefront metrics on http://{bound}/metrics");
        }
        if matches!(
            cli.command,
            Command::Serve(_) | Command::Router(_) | Command::Worker(_)
        ) {
            memory::spawn_heap_trimmer();
        }
        if matches!(
            cli.command,
            Command::Serve(_) | Command::Worker(_) | Command::Run(_)
        ) {
            // What the CPU kernels run on (`WAVEFRONT_AMX=0` keeps AMX tiles out).
            tracing::info!(
                threads = wavefront_models::cpu_threads(),
                isa = wavefront_models::cpu_isa(),
                bf16_products = wavefront_models::cpu_bf16_unit(),
                int8_products = wavefront_models::cpu_int8_unit(),
                "CPU kernels"
            );
        }
        match cli.command {
            Command::Serve(a) => commands::serve(a).await,
            Command::Router(a) => commands::router(a).await,
            Command::Worker(a) => commands::worker(a).await,
            Command::Generate(a) => commands::generate(*a).await,
            Command::Run(a) => commands::run(*a).await,
            Command::ExportGguf(a) => commands::export_gguf(a),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--metrics-listen` is the serving commands' flag, before or after their name; the
    /// client `generate` does not take it after its name.
    #[test]
    fn metrics_listen_belongs_to_the_serving_commands() {
        let parse = |argv: &[&str]| Cli::try_parse_from(argv);
        let worker = parse(&["wavefront", "worker", "--metrics-listen", "127.0.0.1:9"]);
        match worker.map(|c| c.command) {
            Ok(Command::Worker(a)) => {
                assert_eq!(a.metrics.metrics_listen.as_deref(), Some("127.0.0.1:9"));
            }
            other => panic!("{other:?}"),
        }
        let before = parse(&[
            "wavefront",
            "--metrics-listen",
            "127.0.0.1:9",
            "router",
            "--workers",
            "h:1",
        ]);
        assert_eq!(
            before.expect("parses").metrics_listen.as_deref(),
            Some("127.0.0.1:9")
        );
        let client = parse(&["wavefront", "generate", "--metrics-listen", "127.0.0.1:9"]);
        assert!(client.is_err(), "generate took --metrics-listen");
    }
}
