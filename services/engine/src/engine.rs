//! The engine loop on its own thread, and the handle the services talk to.
//!
//! The loop blocks on its command channel while idle; while requests are
//! active it drains pending commands without blocking and runs one
//! [`Scheduler::tick`] per iteration. The family is built on the engine
//! thread itself (device state never crosses threads) and reports readiness
//! through a handshake, so a model that fails to load fails start-up.

use crate::error::{Cause, EngineError};
use crate::family::Family;
use crate::ids::RequestId;
use crate::request::{Exported, Prepared};
use crate::scheduler::{Scheduler, SharedQueue, Waiting};
use crate::sink::EventSink;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Sizes of the engine, validated by the binary at start-up.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Slots in the pool (from the worker's memory budget).
    pub total_slots: usize,
    /// Requests allowed to wait for admission.
    pub queue_capacity: usize,
    /// Requests ticked together at most.
    pub max_active: usize,
    /// Slots admission leaves free for running requests to grow into (families whose programs
    /// take slots as they go; 0 for those that reserve at admission).
    pub watermark_slots: usize,
    /// Rows one tick computes at most (`--max-batch-rows`): prefills that may run in part get
    /// what the whole steps leave ([`crate::Demand`]). `None`: no cap.
    pub max_batch_rows: Option<usize>,
    /// How long a client may leave its request's events unread before the request is cancelled
    /// (`--write-timeout-s`). Until then a request whose client is not reading is paused, and
    /// is the first preempted when the pool is short. `None`: forever.
    pub write_timeout: Option<Duration>,
    /// Whether requests with the same prompt share its pages (`--prompt-sharing`;
    /// [`crate::Family::adopt_prompt`]).
    pub prompt_sharing: bool,
    /// Finished requests kept for their prompt pages, for later requests with the same prompt
    /// to read (`--prefix-cache-entries`; 0: none): given back, least recently used first,
    /// when the pool needs their slots.
    pub prefix_cache_entries: usize,
}

/// A request handed to the engine.
pub struct Submission<P> {
    pub prepared: Prepared<P>,
    pub sink: Box<dyn EventSink>,
    pub deadline: Option<Instant>,
    /// The request's span; each tick span links to it with `follows_from`.
    pub span: tracing::Span,
}

/// A snapshot of the engine's load, for load reports and health.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EngineLoad {
    pub total_slots: usize,
    pub free_slots: usize,
    pub queued: usize,
    pub active: usize,
    pub queue_capacity: usize,
    pub ticks: u64,
    /// Requests preempted and waiting to resume (counted in `active` too).
    pub preempted: usize,
    /// Preemptions since the engine started.
    pub preemptions: u64,
    /// Requests the engine runs at once.
    pub max_active: usize,
}

/// The engine's load as handles see it (what the engine thread publishes after each step; the
/// queue's length is read from the shared queue itself).
#[derive(Default)]
struct LoadState {
    free_slots: usize,
    active: usize,
    ticks: u64,
    preempted: usize,
    preemptions: u64,
}

#[derive(Default)]
struct LoadCounters {
    state: std::sync::Mutex<LoadState>,
    stopped: AtomicBool,
}

impl LoadCounters {
    fn lock(&self) -> std::sync::MutexGuard<'_, LoadState> {
        // A panic while holding it cannot leave the plain counters torn.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Where the engine answers an export.
pub type ExportReply = Box<dyn FnOnce(Result<Exported, EngineError>) + Send>;

enum Command {
    /// A submission was queued: look at the queue (the engine may be waiting for work).
    Wake,
    Shutdown,
    Export {
        id: RequestId,
        reply: ExportReply,
    },
    FinishExport {
        id: RequestId,
        moved: bool,
        reply: Box<dyn FnOnce(Result<(), EngineError>) + Send>,
    },
}

/// Cheap, cloneable access to a running engine.
pub struct EngineHandle<P> {
    tx: SyncSender<Command>,
    queue: Arc<SharedQueue<P>>,
    load: Arc<LoadCounters>,
    next_id: Arc<AtomicU64>,
    config: EngineConfig,
    thread: Option<Arc<JoinHandle<()>>>,
}

impl<P> Clone for EngineHandle<P> {
    fn clone(&self) -> Self {
        Self {
            tx: self.tx.clone(),
            queue: self.queue.clone(),
            load: self.load.clone(),
            next_id: self.next_id.clone(),
            config: self.config.clone(),
            thread: self.thread.clone(),
        }
    }
}

impl<P: Send + 'static> EngineHandle<P> {
    /// Submits a prepared request. Fails at once when the request can never
    /// fit or when the admission queue is full (waiting requests whose caller
    /// is gone or whose deadline passed do not count: they are dropped first).
    pub fn submit(&self, sub: Submission<P>) -> Result<RequestId, EngineError> {
        if self.load.stopped.load(Ordering::Acquire) {
            return Err(EngineError::ShutDown);
        }
        let id = RequestId(self.next_id.fetch_add(1, Ordering::Relaxed));
        let now = Instant::now();
        let w = Waiting {
            id,
            prepared: sub.prepared,
            sink: sub.sink,
            deadline: sub.deadline,
            submitted_at: now,
            span: sub.span,
        };
        self.queue.push(w, now).map_err(|(_, e)| e)?;
        // A full channel already holds a wake-up; a closed one means the engine stopped, and
        // its shutdown fails whatever is queued.
        match self.tx.try_send(Command::Wake) {
            Ok(()) | Err(TrySendError::Full(_)) => Ok(id),
            Err(TrySendError::Disconnected(_)) => Err(EngineError::ShutDown),
        }
    }

    /// Whether a submission now would find a place in the admission queue (see
    /// [`SharedQueue::has_room`]); `Err(QueueFull)` when it would not.
    pub fn check_room(&self) -> Result<(), EngineError> {
        if self.queue.has_room(Instant::now()) {
            Ok(())
        } else {
            Err(EngineError::QueueFull {
                capacity: self.config.queue_capacity,
            })
        }
    }

    pub fn load(&self) -> EngineLoad {
        // The load lock first, then the queue's (the engine publishes in the same order), so a
        // request is always counted: waiting, taken and not yet published, or running.
        let l = self.load.lock();
        let (queued, taken) = self.queue.counts();
        EngineLoad {
            total_slots: self.config.total_slots,
            free_slots: l.free_slots,
            queued,
            active: l.active + taken,
            queue_capacity: self.config.queue_capacity,
            ticks: l.ticks,
            preempted: l.preempted,
            preemptions: l.preemptions,
            max_active: self.config.max_active,
        }
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Asks the engine to stop request `id` at its next step boundary and export its state
    /// ([`Scheduler::export`]); `reply` gets the state, or why not. Blocks while the engine's
    /// command channel is full (call it off the async runtime's threads).
    pub fn export(&self, id: RequestId, reply: ExportReply) {
        if let Err(mpsc::SendError(Command::Export { reply, .. })) =
            self.tx.send(Command::Export { id, reply })
        {
            reply(Err(EngineError::ShutDown));
        }
    }

    /// Settles the move of exported request `id` ([`Scheduler::finish_export`]). Blocks like
    /// [`Self::export`].
    pub fn finish_export(
        &self,
        id: RequestId,
        moved: bool,
        reply: Box<dyn FnOnce(Result<(), EngineError>) + Send>,
    ) {
        if let Err(mpsc::SendError(Command::FinishExport { reply, .. })) =
            self.tx.send(Command::FinishExport { id, moved, reply })
        {
            reply(Err(EngineError::ShutDown));
        }
    }

    /// Asks the engine to fail everything and stop; returns at once.
    pub fn shutdown(&self) {
        let _ = self.tx.try_send(Command::Shutdown);
    }
}

/// Entry point: spawns the engine thread.
pub struct Engine;

impl Engine {
    /// Starts the engine loop. `make_family` runs on the engine thread; its
    /// error (a model that fails to load) is returned here.
    pub fn start<F, M, E>(
        config: EngineConfig,
        make_family: M,
    ) -> Result<EngineHandle<F::Program>, EngineError>
    where
        F: Family,
        M: FnOnce() -> Result<F, E> + Send + 'static,
        E: std::error::Error + Send + Sync + 'static,
    {
        Self::start_labeled("", config, make_family)
    }

    /// [`Engine::start`], with `label` as the `model` label of its metrics.
    pub fn start_labeled<F, M, E>(
        label: &str,
        config: EngineConfig,
        make_family: M,
    ) -> Result<EngineHandle<F::Program>, EngineError>
    where
        F: Family,
        M: FnOnce() -> Result<F, E> + Send + 'static,
        E: std::error::Error + Send + Sync + 'static,
    {
        let label = label.to_owned();
        let (tx, rx) = mpsc::sync_channel::<Command>(2);
        let sched = Scheduler::<F::Program>::new(
            config.total_slots,
            config.queue_capacity,
            config.max_active,
        )
        .with_watermark(config.watermark_slots)
        .with_max_batch_rows(config.max_batch_rows)
        .with_prompt_sharing(config.prompt_sharing)
        .with_prefix_cache(config.prefix_cache_entries)
        .with_write_timeout(config.write_timeout)
        .with_label(&label);
        let queue = sched.shared_queue();
        let load = Arc::new(LoadCounters::default());
        load.lock().free_slots = config.total_slots;
        let (ready_tx, ready_rx) = mpsc::sync_channel::<Result<(), Cause>>(1);
        let thread_load = load.clone();
        let thread = std::thread::Builder::new()
            .name("wavefront-engine".into())
            .spawn(move || {
                let family = match make_family() {
                    Ok(f) => {
                        let _ = ready_tx.send(Ok(()));
                        f
                    }
                    Err(e) => {
                        thread_load.stopped.store(true, Ordering::Release);
                        let _ = ready_tx.send(Err(Cause::new(e)));
                        return;
                    }
                };
                run_loop(family, sched, rx, &thread_load);
                thread_load.stopped.store(true, Ordering::Release);
            })
            .map_err(|e| EngineError::Start(Cause::new(e)))?;
        match ready_rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(EngineError::Start(e)),
            Err(_) => return Err(EngineError::Start(Cause::new(DiedAtStart))),
        }
        Ok(EngineHandle {
            tx,
            queue,
            load,
            next_id: Arc::new(AtomicU64::new(1)),
            config,
            thread: Some(Arc::new(thread)),
        })
    }
}

/// The engine thread ended before it said whether its family was built.
#[derive(Debug, thiserror::Error)]
#[error("the engine thread died during start-up")]
struct DiedAtStart;

fn run_loop<F: Family>(
    mut family: F,
    mut sched: Scheduler<F::Program>,
    rx: Receiver<Command>,
    load: &LoadCounters,
) {
    // While nothing can run (clients not reading, queue head not fitting),
    // wait this long for a command instead of spinning.
    const IDLE_POLL: Duration = Duration::from_millis(2);
    let mut wait: Option<Duration> = None;
    loop {
        // Block only when there is nothing to do; otherwise take what is pending.
        let first = if sched.is_idle() {
            rx.recv().map_err(|_| ())
        } else if let Some(timeout) = wait {
            match rx.recv_timeout(timeout) {
                Ok(c) => Ok(c),
                Err(RecvTimeoutError::Timeout) => Err(()),
                Err(RecvTimeoutError::Disconnected) => Err(()),
            }
        } else {
            rx.try_recv().map_err(|_| ())
        };
        let mut next = first.ok();
        if next.is_none() && sched.is_idle() {
            break; // every handle is gone
        }
        while let Some(cmd) = next.take() {
            match cmd {
                Command::Shutdown => {
                    sched.abort_all(&mut family);
                    publish(&sched, load, family.pool_bytes());
                    return;
                }
                Command::Wake => {}
                Command::Export { id, reply } => {
                    reply(sched.export(&mut family, id, Instant::now()));
                }
                Command::FinishExport { id, moved, reply } => {
                    reply(sched.finish_export(id, moved));
                }
            }
            next = rx.try_recv().ok();
        }
        let before = sched.ticks();
        let report = sched.tick(&mut family, Instant::now());
        publish(&sched, load, family.pool_bytes());
        if report.cancelled + report.expired + report.failed > 0 {
            tracing::debug!(?report, "requests left the engine");
        }
        wait = (sched.ticks() == before && !sched.is_idle()).then_some(IDLE_POLL);
    }
    sched.abort_all(&mut family);
    publish(&sched, load, family.pool_bytes());
}

fn publish<P: Send + 'static>(sched: &Scheduler<P>, load: &LoadCounters, pool_bytes: u64) {
    {
        let mut l = load.lock();
        // Slots only the prefix cache holds are free to any request.
        l.free_slots = sched.available();
        l.active = sched.running();
        l.ticks = sched.ticks();
        l.preempted = sched.preempted();
        l.preemptions = sched.preemptions();
        let free_places = sched
            .max_active()
            .saturating_sub(sched.running())
            .min(l.free_slots);
        sched.shared_queue().settled(free_places);
    }
    sched.publish_gauges();
    sched.publish_pool_bytes(pool_bytes);
}
