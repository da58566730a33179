//! The threads the CPU kernels split a call over: the calling thread plus `threads - 1`
//! workers that spin briefly between calls and then park.
//!
//! A forward is a chain of short kernel calls (tens of microseconds each at decode), so the
//! cost of handing work to other threads matters as much as the work: a pool whose caller
//! blocks on a lock and whose workers sleep between calls pays two context switches per call.
//! Here the caller publishes the call and takes parts itself; workers that are spinning pick
//! the rest up at once; a worker parks only after [`SPIN`] of idleness and is unparked by the
//! next call. Parts are claimed from a shared counter, so a slow thread does not hold the
//! others up. A waiting thread (the caller for the workers' parts, a worker between calls)
//! spins for [`YIELD_AFTER`] and then yields its core at every check: in a server whose network
//! threads share the cores, a thread that only spins holds a core they need (measured: a
//! Huginn request's p99 through `serve`, unloaded, 12.3 → 7.5 ms; forwards unchanged within
//! noise; docs/benchmarks.md).
//!
//! One call runs at a time: a second caller (another engine) that finds the pool busy runs its
//! call on its own thread. A call made from inside a part runs inline.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker spins before it parks.
const SPIN: Duration = Duration::from_micros(500);

/// How long a thread waiting on other threads (the caller for the parts workers took, a worker
/// between calls) spins before it yields its core at every check. When every core is busy
/// (a server's network threads, another process), a thread that only spins holds a core that
/// the thread it waits for, or the one that would hand it work, needs; yielding lends it.
const YIELD_AFTER: Duration = Duration::from_micros(50);

/// Waits until `ready()`: spins for [`YIELD_AFTER`], then yields the core between checks.
fn wait_until(ready: impl Fn() -> bool) {
    let start = Instant::now();
    let mut spins = 0u32;
    while !ready() {
        spins += 1;
        if spins.is_multiple_of(64) && start.elapsed() > YIELD_AFTER {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
}

type Job = *const (dyn Fn(usize) + Sync);

struct Shared {
    /// Bumped once per call; workers wait for it to change.
    generation: AtomicUsize,
    /// The call's parts and the next one to claim.
    parts: AtomicUsize,
    next: AtomicUsize,
    /// Parts finished.
    done: AtomicUsize,
    /// Workers inside a call's parts (they took its function under the `job` lock).
    active: AtomicUsize,
    /// The call's function, valid while `done < parts` (the caller waits for that).
    job: Mutex<Option<SendJob>>,
    stop: AtomicBool,
    panicked: AtomicBool,
}

#[derive(Clone, Copy)]
struct SendJob(Job);
// SAFETY: the function is `Sync` and outlives every use (the caller waits for all parts).
unsafe impl Send for SendJob {}

/// The kernels' thread pool.
pub struct Pool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// Serialises calls; a caller that finds it taken runs inline.
    call: Mutex<()>,
}

thread_local! {
    static IN_PART: Cell<bool> = const { Cell::new(false) };
}

impl Pool {
    fn new(threads: usize) -> Self {
        let shared = Arc::new(Shared {
            generation: AtomicUsize::new(0),
            parts: AtomicUsize::new(0),
            next: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            active: AtomicUsize::new(0),
            job: Mutex::new(None),
            stop: AtomicBool::new(false),
            panicked: AtomicBool::new(false),
        });
        let workers = (1..threads.max(1))
            .map(|i| {
                let shared = shared.clone();
                std::thread::Builder::new()
                    .name(format!("wavefront-cpu-{i}"))
                    .spawn(move || worker(&shared))
                    .expect("spawn a CPU kernel thread")
            })
            .collect();
        Self {
            shared,
            workers,
            call: Mutex::new(()),
        }
    }

    /// Threads a call uses (the caller included).
    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Runs `f(0)`, ..., `f(parts - 1)` on the caller and the workers; returns when all are
    /// done. Panics if a part panicked.
    pub fn run(&self, parts: usize, f: &(dyn Fn(usize) + Sync)) {
        if parts == 0 {
            return;
        }
        let inline = parts == 1 || self.workers.is_empty() || IN_PART.with(Cell::get);
        let guard = if inline {
            None
        } else {
            self.call.try_lock().ok()
        };
        let Some(_guard) = guard else {
            (0..parts).for_each(f);
            return;
        };
        let s = &*self.shared;
        // SAFETY (lifetime): `f` outlives the call, which waits until every part is done and
        // clears the job before returning.
        let job: Job = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), Job>(f) };
        // The counters are reset before the job is published: a worker still on its way from
        // the previous call's signal may take the job as soon as the lock shows it, and must
        // then see this call's counters (the lock's release orders the stores before it). The
        // other order let such a worker claim a part against the last call's count and have
        // its `done` increment wiped by the reset, leaving this call waiting forever.
        s.next.store(0, Ordering::Relaxed);
        s.done.store(0, Ordering::Relaxed);
        s.parts.store(parts, Ordering::Relaxed);
        *s.job.lock().unwrap_or_else(|e| e.into_inner()) = Some(SendJob(job));
        s.generation.fetch_add(1, Ordering::AcqRel);
        for w in &self.workers {
            w.thread().unpark();
        }
        IN_PART.with(|c| c.set(true));
        claim(s, f);
        IN_PART.with(|c| c.set(false));
        wait_until(|| s.done.load(Ordering::Acquire) >= parts);
        // No worker may take the function from here on, and none still runs it on return.
        *s.job.lock().unwrap_or_else(|e| e.into_inner()) = None;
        wait_until(|| s.active.load(Ordering::Acquire) == 0);
        if s.panicked.swap(false, Ordering::AcqRel) {
            panic!("a CPU kernel part panicked on a pool thread");
        }
    }
}

/// Claims and runs parts until none is left.
fn claim(s: &Shared, f: &(dyn Fn(usize) + Sync)) {
    let parts = s.parts.load(Ordering::Acquire);
    loop {
        let i = s.next.fetch_add(1, Ordering::AcqRel);
        if i >= parts {
            return;
        }
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(i))).is_err() {
            s.panicked.store(true, Ordering::Release);
        }
        s.done.fetch_add(1, Ordering::AcqRel);
    }
}

fn worker(s: &Shared) {
    IN_PART.with(|c| c.set(true));
    let mut seen = s.generation.load(Ordering::Acquire);
    loop {
        let idle = Instant::now();
        let mut spins = 0u32;
        loop {
            if s.stop.load(Ordering::Acquire) {
                return;
            }
            let g = s.generation.load(Ordering::Acquire);
            if g != seen {
                seen = g;
                break;
            }
            spins += 1;
            if spins.is_multiple_of(64) && idle.elapsed() > SPIN {
                std::thread::park_timeout(Duration::from_millis(100));
            } else if spins.is_multiple_of(64) && idle.elapsed() > YIELD_AFTER {
                // Between calls: a thread that wants this core gets it.
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        let job = {
            let guard = s.job.lock().unwrap_or_else(|e| e.into_inner());
            if guard.is_some() {
                s.active.fetch_add(1, Ordering::AcqRel);
            }
            *guard
        };
        if let Some(SendJob(job)) = job {
            // SAFETY: the caller keeps the function alive until `active` is back to zero.
            let f: &(dyn Fn(usize) + Sync) = unsafe { &*job };
            claim(s, f);
            s.active.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        for w in self.workers.drain(..) {
            w.thread().unpark();
            let _ = w.join();
        }
    }
}

static POOL: OnceLock<Pool> = OnceLock::new();

/// The process's pool, sized by [`init`] (the machine's cores when nobody sized it).
pub fn pool() -> &'static Pool {
    POOL.get_or_init(|| Pool::new(std::thread::available_parallelism().map_or(1, |n| n.get())))
}

/// Sizes the pool; `Err` when it already exists.
pub fn init(threads: usize) -> Result<(), crate::KernelError> {
    let mut fresh = Some(threads);
    POOL.get_or_init(|| Pool::new(fresh.take().expect("first init")));
    match fresh {
        None => Ok(()),
        Some(_) => Err(crate::KernelError::PoolStarted),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_part_runs_once_and_nested_calls_run_inline() {
        let p = Pool::new(3);
        for parts in [0usize, 1, 2, 7, 100] {
            let hits: Vec<AtomicUsize> = (0..parts).map(|_| AtomicUsize::new(0)).collect();
            p.run(parts, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
                // A nested call completes inline.
                let inner = AtomicUsize::new(0);
                p.run(3, &|_| {
                    inner.fetch_add(1, Ordering::Relaxed);
                });
                assert_eq!(inner.load(Ordering::Relaxed), 3);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
        }
    }

    #[test]
    fn a_panicking_part_is_reported_to_the_caller_and_the_pool_stays_usable() {
        let p = Pool::new(2);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            p.run(8, &|i| assert!(i != 5, "part 5"));
        }));
        assert!(r.is_err());
        let n = AtomicUsize::new(0);
        p.run(4, &|_| {
            n.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(n.load(Ordering::Relaxed), 4);
    }
}
