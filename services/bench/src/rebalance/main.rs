//! `bench-rebalance`: what the router's `--rebalance` does to latency when one worker has a queue
//! and another is idle.
//!
//! The scenario is a scale-out: a burst of requests reaches a router whose only live worker (A)
//! admits `--max-active` of them and queues the rest; a second worker (B) of the same model
//! joins as soon as A holds the whole burst (`--join-after-ms` later). Without rebalancing only
//! new arrivals would reach B, so the burst drains through A alone; with it, the router moves
//! requests from A (whose queue is not empty) to B while B is idle. A third arrangement, B up
//! before the burst, is the bound: the least-loaded pick splits the burst from the start.
//!
//! Everything runs in this process over loopback gRPC: two workers (each its own engine of the
//! same synthetic Huginn weights), the router with its discovery loop, and one streaming client
//! per request. The CPU kernels run on one thread, so each worker's engine has a core of its
//! own on a two-core machine, as two one-core machines would. Arrangements alternate within a
//! round. Per request: latency from the burst to its last token, time to its first token, and
//! its moves; tokens are checked identical across arrangements (seeded sampling).
//! Prints a markdown table on stdout and progress on stderr.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use clap::Parser;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tonic::transport::Channel;
use wavefront_bench::run;
use wavefront_bench::synthetic::huginn;
use wavefront_bench::table;
use wavefront_bench::table::Align::{Left, Right};
use wavefront_proto::v1 as pb;
use wavefront_proto::v1::generation_client::GenerationClient;
use wavefront_proto::worker::v1 as wpb;
use wavefront_proto::worker::v1::worker_client::WorkerClient;
use wavefront_router::{Discovery, DiscoveryConfig, RouterService};
use wavefront_schemes::{Fingerprint, LoadOptions, ServedModel};
use wavefront_worker::{WorkerConfig, WorkerService};

#[derive(Debug, Clone, Parser)]
#[command(
    about = "Latency of a burst on one worker while another joins, with and without --rebalance"
)]
struct Args {
    /// Requests in the burst.
    #[arg(long, default_value_t = 8)]
    requests: usize,
    /// Requests each worker runs at once (`--max-active`); the rest wait in its queue.
    #[arg(long, default_value_t = 2)]
    max_active: usize,
    /// Tokens each request generates.
    #[arg(long, default_value_t = 128)]
    max_new_tokens: u32,
    /// Delay between the burst being on A and B starting.
    #[arg(long, default_value_t = 0)]
    join_after_ms: u64,
    /// The router's discovery round (`--refresh-ms`).
    #[arg(long, default_value_t = 100)]
    refresh_ms: u64,
    /// Rounds; each runs every arrangement once, in alternating order.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Device, dtype and kernels; `--threads` 0 means one thread here (a core per worker).
    #[command(flatten)]
    target: run::Target,
    #[arg(long, default_value_t = 7)]
    seed: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Arrangement {
    /// B joins after the burst; no rebalancing.
    Joins,
    /// B joins after the burst; `--rebalance`.
    JoinsRebalance,
    /// B is up before the burst (the bound).
    BothUp,
}

impl Arrangement {
    fn label(self) -> &'static str {
        match self {
            Self::Joins => "B joins after the burst, no rebalancing",
            Self::JoinsRebalance => "B joins after the burst, --rebalance",
            Self::BothUp => "B up before the burst (bound)",
        }
    }
}

/// What one request of the burst saw.
#[derive(Debug, Clone)]
struct Seen {
    tokens: Vec<u32>,
    latency: Duration,
    first_token: Duration,
    migrations: u32,
}

struct Served {
    a: Arc<dyn ServedModel>,
    b: Arc<dyn ServedModel>,
}

fn models(a: &Args) -> Result<Served> {
    let shape = huginn::Shape {
        n_embd: 512,
        n_heads: 8,
        intermediate_size: 1376,
        vocab_size: 16384,
        prelude: 1,
        core: 2,
        coda: 1,
        mean_recurrence: 8,
    };
    let cfg = shape.config()?;
    let seed = a.seed;
    let make = || -> Result<Arc<dyn ServedModel>> {
        let c = cfg.clone();
        Ok(wavefront_schemes::recurrent_depth::serve_model(
            cfg.clone(),
            None,
            LoadOptions {
                max_active: a.max_active,
                queue_capacity: a.requests.max(16),
                memory_budget_bytes: 2 << 30,
                // Both engines' weights come from one seed: the same model, so moves are allowed.
                fingerprint: Fingerprint::given(format!("synthetic-huginn-{seed}")),
                ..a.target.load_options("synthetic-huginn")?
            },
            move |device, dtype| huginn::random_model(&c, seed, device, dtype),
        )?)
    };
    Ok(Served {
        a: make()?,
        b: make()?,
    })
}

fn request(a: &Args, i: usize) -> pb::GenerateRequest {
    use pb::generate_request::{Prompt, Scheme};
    let ids = run::random_prompt(a.seed, i as u64, 32, 0..16000);
    pb::GenerateRequest {
        model: "synthetic-huginn".into(),
        prompt: Some(Prompt::TokenIds(pb::TokenIds { ids })),
        max_new_tokens: a.max_new_tokens,
        scheme: Some(Scheme::Ar(pb::ArScheme {
            num_steps: Some(8),
            ..Default::default()
        })),
        sampling: Some(pb::SamplingParams {
            temperature: 0.8,
            seed: Some(a.seed + i as u64),
            ..Default::default()
        }),
        ..Default::default()
    }
}

async fn connect(addr: SocketAddr) -> Result<Channel> {
    Ok(Channel::from_shared(format!("http://{addr}"))?
        .connect()
        .await?)
}

/// A worker serving `model` on `listener` until `stop` changes.
fn start_worker(
    model: Arc<dyn ServedModel>,
    listener: TcpListener,
    stop: &watch::Receiver<bool>,
) -> Result<tokio::task::JoinHandle<Result<()>>> {
    let addr = listener.local_addr()?;
    let service = WorkerService::new(vec![model], addr.to_string());
    let mut rx = stop.clone();
    Ok(tokio::spawn(wavefront_worker::serve(
        service,
        wavefront_net::Listener::new(listener, wavefront_net::ServerLimits::default(), "grpc"),
        WorkerConfig::default(),
        async move {
            let _ = rx.changed().await;
        },
    )))
}

/// Active plus queued requests on the worker at `addr`.
async fn held(addr: SocketAddr) -> Result<u32> {
    let mut w = WorkerClient::new(connect(addr).await?);
    let report = w
        .get_load(wpb::LoadRequest { interval_ms: 0 })
        .await?
        .into_inner();
    Ok(report
        .models
        .iter()
        .map(|m| m.active_requests + m.queued_requests)
        .sum())
}

/// One streaming request through the router; times count from `burst`.
async fn one(router: SocketAddr, req: pb::GenerateRequest, burst: Instant) -> Result<Seen> {
    let mut client = GenerationClient::new(connect(router).await?);
    let mut stream = client.generate_stream(req).await?.into_inner();
    let mut tokens = Vec::new();
    let mut first_token = None;
    while let Some(m) = stream.message().await? {
        match m.event {
            Some(pb::generate_stream_response::Event::Tokens(c)) => {
                if first_token.is_none() && !c.token_ids.is_empty() {
                    first_token = Some(burst.elapsed());
                }
                tokens.extend(c.token_ids);
            }
            Some(pb::generate_stream_response::Event::Done(done)) => {
                return Ok(Seen {
                    tokens,
                    latency: burst.elapsed(),
                    first_token: first_token.unwrap_or_else(|| burst.elapsed()),
                    migrations: done.stats.map_or(0, |s| s.migrations),
                });
            }
            _ => {}
        }
    }
    bail!("the stream ended without its final message")
}

async fn burst(a: &Args, how: Arrangement) -> Result<Vec<Seen>> {
    // A worker's shutdown shuts its engine down: each arrangement builds its own.
    let served = tokio::task::block_in_place(|| models(a))?;
    let (stop_tx, stop_rx) = watch::channel(false);
    let la = TcpListener::bind("127.0.0.1:0").await?;
    let a_addr = la.local_addr()?;
    let mut tasks = vec![start_worker(served.a.clone(), la, &stop_rx)?];
    // B's address is known to the router from the start; B listens only once it joins.
    let b_addr = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
    let start_b = |tasks: &mut Vec<_>, l: TcpListener| -> Result<()> {
        tasks.push(start_worker(served.b.clone(), l, &stop_rx)?);
        Ok(())
    };
    if how == Arrangement::BothUp {
        start_b(&mut tasks, TcpListener::bind(b_addr).await?)?;
    }
    let discovery = Discovery::default();
    let refresh = Duration::from_millis(a.refresh_ms);
    let cfg = DiscoveryConfig {
        targets: vec![a_addr.to_string(), b_addr.to_string()],
        refresh,
        poll_timeout: Duration::from_millis(a.refresh_ms.clamp(200, 2000)),
        forget_after: refresh * 10,
        worker_token: Default::default(),
        worker_tls: None,
    };
    let want_up = if how == Arrangement::BothUp { 2 } else { 1 };
    let ready = Instant::now();
    loop {
        discovery.refresh(&cfg).await;
        if discovery.snapshot().iter().filter(|w| w.up).count() >= want_up {
            break;
        }
        ensure!(
            ready.elapsed() < Duration::from_secs(30),
            "workers never came up"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let discovery_task = tokio::spawn(discovery.clone().run(cfg));
    let lr = TcpListener::bind("127.0.0.1:0").await?;
    let router_addr = lr.local_addr()?;
    let service = RouterService::new(discovery).with_rebalance(how == Arrangement::JoinsRebalance);
    let mut rx = stop_rx.clone();
    let router_task = tokio::spawn(wavefront_router::serve(
        service,
        wavefront_net::Listener::new(lr, wavefront_net::ServerLimits::default(), "grpc"),
        async move {
            let _ = rx.changed().await;
        },
    ));

    let started = Instant::now();
    let mut calls: Vec<_> = (0..a.requests)
        .map(|i| tokio::spawn(one(router_addr, request(a, i), started)))
        .collect();
    if how != Arrangement::BothUp {
        loop {
            let h = held(a_addr).await?;
            if h >= a.requests as u32 {
                break;
            }
            if let Some(i) = calls.iter().position(|c| c.is_finished()) {
                let ended = calls.swap_remove(i).await?;
                bail!("a request ended before the burst was on A ({h} held): {ended:?}");
            }
            ensure!(
                started.elapsed() < Duration::from_secs(60),
                "the burst never reached A ({h} held)"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        tokio::time::sleep(Duration::from_millis(a.join_after_ms)).await;
        start_b(&mut tasks, TcpListener::bind(b_addr).await?)?;
    }
    let mut seen = Vec::new();
    for c in calls {
        seen.push(c.await??);
    }
    let _ = stop_tx.send(true);
    router_task.await??;
    for t in tasks {
        t.await??;
    }
    discovery_task.abort();
    Ok(seen)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i]
}

fn main() -> Result<()> {
    let mut a = Args::parse();
    // `RUST_LOG=wavefront_router=debug` shows the router's moves.
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    if a.target.threads == 0 {
        a.target.threads = 1;
    }
    a.target.init_threads()?;
    ensure!(
        a.requests > a.max_active,
        "--requests must exceed --max-active for a queue"
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let all = [
        Arrangement::Joins,
        Arrangement::JoinsRebalance,
        Arrangement::BothUp,
    ];
    let mut rows = Vec::new();
    let mut reference: Option<Vec<Vec<u32>>> = None;
    for round in 0..a.rounds {
        let mut order = all.to_vec();
        if round % 2 == 1 {
            order.reverse();
        }
        for how in order {
            eprintln!("round {} of {}: {}", round + 1, a.rounds, how.label());
            let seen = rt.block_on(burst(&a, how)).with_context(|| how.label())?;
            let tokens: Vec<Vec<u32>> = seen.iter().map(|s| s.tokens.clone()).collect();
            match &reference {
                None => reference = Some(tokens),
                Some(r) => {
                    let differ: Vec<String> = r
                        .iter()
                        .zip(&seen)
                        .enumerate()
                        .filter(|(_, (want, s))| **want != s.tokens)
                        .map(|(i, (want, s))| {
                            let at = want.iter().zip(&s.tokens).take_while(|(x, y)| x == y).count();
                            format!(
                                "request {i} (moved {}): {} tokens against {}, first difference at {at}",
                                s.migrations,
                                s.tokens.len(),
                                want.len()
                            )
                        })
                        .collect();
                    ensure!(
                        differ.is_empty(),
                        "{}: tokens differ from the first arrangement's: {}",
                        how.label(),
                        differ.join("; ")
                    );
                }
            }
            rows.push((round, how, seen));
        }
    }
    rows.sort_by_key(|(round, how, _)| (*how as usize, *round));
    let mut out = Vec::new();
    for (round, how, seen) in &rows {
        let mut lat: Vec<f64> = seen.iter().map(|s| ms(s.latency)).collect();
        lat.sort_by(f64::total_cmp);
        let ttft: Vec<f64> = seen.iter().map(|s| ms(s.first_token)).collect();
        let moved: u32 = seen.iter().map(|s| s.migrations).sum();
        out.push(vec![
            how.label().to_string(),
            (round + 1).to_string(),
            format!("{:.0}", table::mean(lat.iter().copied())),
            format!("{:.0}", percentile(&lat, 0.5)),
            format!("{:.0}", percentile(&lat, 0.9)),
            format!("{:.0}", lat[lat.len() - 1]),
            format!("{:.0}", table::mean(ttft)),
            moved.to_string(),
        ]);
    }
    println!(
        "{} requests of {} tokens (seeded), max-active {} per worker, router round {} ms, B joins \
         {} ms after the burst is on A; synthetic Huginn 512 wide, 1/2/1 layers, r = 8; \
         times in ms from the burst; tokens identical in every arrangement.\n",
        a.requests, a.max_new_tokens, a.max_active, a.refresh_ms, a.join_after_ms
    );
    table::print_header(&[
        ("arrangement", Left),
        ("round", Right),
        ("mean latency", Right),
        ("p50", Right),
        ("p90", Right),
        ("last done", Right),
        ("mean first token", Right),
        ("moves", Right),
    ]);
    for row in out {
        println!("| {} |", row.join(" | "));
    }
    Ok(())
}
