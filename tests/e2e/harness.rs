//! Starting real `wavefront` processes on 127.0.0.1 port 0 and waiting for
//! them on gRPC health (never on sleeps), and offline `wavefront run --json`
//! on a fixture.

use std::ffi::OsStr;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use tonic::transport::Channel;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;
use wavefront_proto::worker::v1::worker_client::WorkerClient;
use wavefront_proto::worker::v1::{LoadRequest, ModelLoad};

pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_wavefront")
}

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

/// `wavefront run --model tests/fixtures/FIXTURE --json --log-filter warn ARGS`: offline
/// generation on a fixture; its output, whatever its exit status.
pub fn wavefront_run<S: AsRef<OsStr>>(fixture_name: &str, args: &[S]) -> Output {
    wavefront_run_with_env(fixture_name, args, &[])
}

/// [`wavefront_run`] with extra environment variables.
pub fn wavefront_run_with_env<S: AsRef<OsStr>>(
    fixture_name: &str,
    args: &[S],
    env: &[(&str, &str)],
) -> Output {
    let model = fixture(fixture_name);
    Command::new(bin())
        .args(["run", "--model", model.to_str().unwrap(), "--json"])
        .args(["--log-filter", "warn"])
        .args(args)
        .envs(env.iter().copied())
        .output()
        .expect("run wavefront run")
}

/// Panics with the run's stderr unless it succeeded.
fn assert_succeeded(out: &Output) {
    assert!(
        out.status.success(),
        "wavefront run failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The JSON object a run that must have succeeded printed on stdout (its result).
pub fn json_result(out: &Output) -> serde_json::Value {
    assert_succeeded(out);
    serde_json::from_slice(&out.stdout).expect("one JSON object on stdout")
}

/// The JSON lines a run that must have succeeded printed on stdout: with `--stream-canvas` one
/// per canvas event, then the result.
pub fn json_lines(out: &Output) -> Vec<serde_json::Value> {
    assert_succeeded(out);
    std::str::from_utf8(&out.stdout)
        .expect("UTF-8 on stdout")
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect()
}

/// A child process killed when dropped.
pub struct Proc {
    pub child: Child,
    pub addr: SocketAddr,
}

impl Proc {
    /// Sends SIGTERM (graceful shutdown) and waits for the exit status.
    #[allow(dead_code)]
    pub fn terminate(mut self) -> std::process::ExitStatus {
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(self.child.id().to_string())
            .status();
        let status = self.child.wait().expect("wait");
        std::mem::forget(self);
        status
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `wavefront ARGS` and waits for its "listening on ADDR" line.
pub fn spawn(args: &[&str]) -> Proc {
    spawn_with_env(args, &[])
}

/// Starts `program ARGS` (a shell around `wavefront`, say) and waits for the "listening on
/// ADDR" line of the `wavefront` it runs.
#[allow(dead_code)]
pub fn spawn_program(program: &str, args: &[&str], env: &[(&str, &str)]) -> Proc {
    spawn_command(
        Command::new(program).args(args).envs(env.iter().copied()),
        args,
    )
}

/// [`spawn`] with extra environment variables. The processes log at `warn` unless
/// `WAVEFRONT_E2E_LOG` sets another filter (e.g. `info,wavefront_router=debug`).
pub fn spawn_with_env(args: &[&str], env: &[(&str, &str)]) -> Proc {
    spawn_command(
        Command::new(bin())
            .args(args)
            .env(
                "RUST_LOG",
                std::env::var("WAVEFRONT_E2E_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
            .envs(env.iter().copied()),
        args,
    )
}

fn spawn_command(command: &mut Command, args: &[&str]) -> Proc {
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn wavefront");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(addr) = line.split("listening on ").nth(1) {
                let _ = tx.send(addr.trim().to_owned());
            }
        }
    });
    let addr = match rx.recv_timeout(Duration::from_secs(120)) {
        Ok(a) => a.parse().expect("address line"),
        Err(_) => {
            let _ = child.kill();
            panic!("wavefront {args:?} did not report its address");
        }
    };
    Proc { child, addr }
}

/// Starts `wavefront router --listen LISTEN --workers WORKERS --refresh-ms REFRESH_MS EXTRA`
/// and waits for its "listening on ADDR" line.
pub fn spawn_router(listen: &str, workers: &str, refresh_ms: u64, extra: &[&str]) -> Proc {
    let refresh = refresh_ms.to_string();
    let mut args = vec![
        "router",
        "--listen",
        listen,
        "--workers",
        workers,
        "--refresh-ms",
        &refresh,
    ];
    args.extend_from_slice(extra);
    spawn(&args)
}

/// Starts `wavefront worker --listen 127.0.0.1:0 --model tests/fixtures/FIXTURE ARGS` and waits
/// for its "listening on ADDR" line.
pub fn spawn_worker(fixture_name: &str, args: &[&str]) -> Proc {
    spawn_worker_with_env(fixture_name, args, &[])
}

/// [`spawn_worker`] with extra environment variables.
pub fn spawn_worker_with_env(fixture_name: &str, args: &[&str], env: &[(&str, &str)]) -> Proc {
    let model = fixture(fixture_name);
    let mut all = vec![
        "worker",
        "--listen",
        "127.0.0.1:0",
        "--model",
        model.to_str().unwrap(),
    ];
    all.extend_from_slice(args);
    spawn_with_env(&all, env)
}

/// The models `client`'s server lists (`ListModels`).
pub async fn served_models(
    client: &mut wavefront_proto::v1::generation_client::GenerationClient<Channel>,
) -> Vec<wavefront_proto::v1::ModelInfo> {
    client
        .list_models(wavefront_proto::v1::ListModelsRequest {})
        .await
        .expect("list models")
        .into_inner()
        .models
}

pub async fn channel(addr: SocketAddr) -> Channel {
    Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .expect("connect")
}

/// Waits until `service` reports SERVING on the standard health API.
pub async fn wait_serving(addr: SocketAddr, service: &str) {
    let start = Instant::now();
    loop {
        if let Ok(ch) = Channel::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
        {
            let mut h = HealthClient::new(ch);
            // `watch` streams status changes: no polling interval needed.
            if let Ok(resp) = h
                .watch(HealthCheckRequest {
                    service: service.into(),
                })
                .await
            {
                let mut stream = resp.into_inner();
                while let Ok(Some(msg)) = stream.message().await {
                    if msg.status == ServingStatus::Serving as i32 {
                        return;
                    }
                }
            }
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "{addr} never became healthy"
        );
        tokio::task::yield_now().await;
    }
}

/// A worker on the fixture model and a router in front of it.
pub struct Stack {
    pub worker: Proc,
    pub router: Proc,
}

pub async fn stack(worker_args: &[&str]) -> Stack {
    let mut args = vec!["--served-name", "huginn-tiny"];
    args.extend_from_slice(worker_args);
    let worker = spawn_worker("huginn", &args);
    wait_serving(worker.addr, "wavefront.worker.v1.Worker").await;
    let workers = worker.addr.to_string();
    let router = spawn(&[
        "router",
        "--listen",
        "127.0.0.1:0",
        "--workers",
        &workers,
        "--refresh-ms",
        "200",
    ]);
    wait_serving(router.addr, "wavefront.v1.Generation").await;
    Stack { worker, router }
}

/// The load report of a worker's (only) model.
pub async fn load(worker: SocketAddr) -> ModelLoad {
    let mut w = WorkerClient::new(channel(worker).await);
    w.get_load(LoadRequest { interval_ms: 0 })
        .await
        .expect("load report")
        .into_inner()
        .models
        .remove(0)
}

/// Waits until the load of the worker's (only) model satisfies `f` (20 s at most; the failure
/// names `what`). A request is admitted at the engine's next step after its answer's head.
pub async fn wait_load(worker: SocketAddr, what: &str, f: impl Fn(&ModelLoad) -> bool) {
    let start = Instant::now();
    loop {
        let m = load(worker).await;
        if f(&m) {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "never {what}: {m:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Starts a worker of `fixture` listening on `addr` (a worker the router knew before it came
/// up).
pub fn spawn_worker_at(fixture_name: &str, addr: SocketAddr) -> Proc {
    let model = fixture(fixture_name);
    let listen = addr.to_string();
    spawn(&[
        "worker",
        "--listen",
        &listen,
        "--model",
        model.to_str().expect("a UTF-8 path"),
    ])
}

/// Waits until the worker holds nothing (every slot free, nothing active or queued), for at
/// most `within`; how long it took.
pub async fn wait_whole(worker: SocketAddr, within: Duration) -> Duration {
    let start = Instant::now();
    loop {
        let m = load(worker).await;
        if m.free_slots == m.total_slots && m.active_requests == 0 && m.queued_requests == 0 {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < within,
            "the worker still holds work: {m:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
